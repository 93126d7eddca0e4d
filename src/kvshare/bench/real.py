"""`kvshare bench real`: a released-format checkpoint at a named model's real per-layer sizes, run by
kvshare and by llama.cpp on the same bytes (issue 37 items 2 and 3).

1. Checkpoint: `real_config(model, layers, experts, vocab)` written by `write_released_checkpoint`
   (FP4 routed experts, FP8 linears, every value on its grid), or reused from ``--checkpoint DIR``
   (written there when the directory holds none; its own config.json is then what runs).
2. Loads, each in a fresh process: kvshare's `load_model` (`load_memory.measure_load`: seconds,
   MB/s, peak resident-set growth, then 8 greedy tokens) and llama.cpp's (`real_llamacpp`).
3. One kvshare model (`load_model`, bf16, FP8 / FP4 kept packed, quantisation on as released: FP8
   activations and cache formats) and three engines (decode batch 1, decode batch 4, prefill),
   prefix caching off; llama.cpp on the GGUF its converter made of the same checkpoint (MXFP4
   experts, Q8_0 from FP8). Per round and thread count `t` (torch's intra-op threads and
   llama.cpp's ``n_threads`` = `t`): the copy bandwidth at `t` threads, then both engines (the order of
   engines and of thread counts alternates between rounds): decode batch 1 and 4 (`new_tokens`
   tokens after a `prompt_len`-token prompt; tok/s = batch / median step) and the prefill of one
   `prefill_len`-token prompt (prompt in, first token out). One untimed warm-up per engine and
   thread count first. Reported: each measure's best over `repeats` rounds (`real_table`).
4. Weight bytes per batch-1 decode token: `bandwidth.weight_bytes_per_step` on the loaded model
   (packed bytes of FP8 / FP4 weights; attention, shared expert, top-k of the routed experts, head,
   one embedding row), over the best median step, over the copy read bandwidth at `t` threads.

kvshare's greedy tokens must be identical at every thread count and round (the kernels' bits do not
depend on the threads); the report says whether they were. llama.cpp's tokens are compared for
information only (Q8_0 is not FP8, and these random-weight models have small top-2 gaps).
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvshare.bench.report import Section, print_sections, save

DEFAULTS = {"v4-flash": (4, 32), "v4.1-flash": (6, 8)}  # (layers, experts) that fit a 24 GiB machine


@dataclass
class RealOptions:
    """What `kvshare bench real` was asked to do (module doc); layers / experts None: `DEFAULTS`."""

    model: str = "v4-flash"
    layers: int | None = None
    experts: int | None = None
    vocab: int = 8192
    threads: tuple[int, ...] = ()  # () = 1 .. os.cpu_count()
    checkpoint: Path | None = None
    prompt_len: int = 32
    new_tokens: int = 16
    prefill_len: int = 512
    repeats: int = 3
    copy_mib: int = 512
    seed: int = 0
    llamacpp: bool = True
    fetch: bool = True
    out_dir: Path = Path("bench-results")
    name: str = "bench-real"

    def command(self) -> str:
        """The command line that reproduces this run (every size spelled out)."""
        parts = [f"kvshare bench real --model {self.model} --layers {self.layers} --experts {self.experts}",
                 f"--vocab {self.vocab} --threads {','.join(map(str, self.threads))}",
                 f"--prompt-len {self.prompt_len} --new-tokens {self.new_tokens} --prefill-len {self.prefill_len}",
                 f"--repeats {self.repeats} --copy-mib {self.copy_mib} --seed {self.seed}"]
        if self.checkpoint:
            parts.append(f"--checkpoint {self.checkpoint}")
        if not self.llamacpp:
            parts.append("--no-llamacpp")
        return " ".join(parts)

    def resolved(self) -> "RealOptions":
        from kvshare.bench.real_checkpoint import MODELS

        if self.model not in MODELS:
            raise ValueError(f"--model must be one of {sorted(MODELS)}, got {self.model!r}")
        layers, experts = DEFAULTS[self.model]
        threads = self.threads or tuple(range(1, (os.cpu_count() or 1) + 1))
        if min(threads) < 1:
            raise ValueError(f"thread counts must be >= 1, got {threads}")
        return RealOptions(**{**asdict(self), "layers": self.layers or layers, "experts": self.experts or experts,
                              "threads": tuple(threads), "checkpoint": self.checkpoint,
                              "out_dir": self.out_dir})


def prepare_checkpoint(opts: RealOptions, tmp: Path) -> tuple[Path, Any, str]:
    """(checkpoint directory, its config, a note): reused from ``opts.checkpoint`` or written."""
    from kvshare.bench.real_checkpoint import real_config, write_released_checkpoint
    from kvshare.config import load_config

    ck = Path(opts.checkpoint) if opts.checkpoint else tmp / "ckpt"
    if (ck / "config.json").is_file() and any(ck.glob("*.safetensors")):
        return ck, load_config(ck), f"checkpoint reused from {ck}"
    cfg = real_config(opts.model, opts.layers, opts.experts, opts.vocab)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    write_released_checkpoint(cfg, ck, opts.seed)
    return ck, cfg, f"checkpoint written to {ck} in {time.perf_counter() - t0:.0f} s"


def kv_engines(model: torch.nn.Module, opts: RealOptions) -> dict[str, Any]:
    """The decode batch 1 / batch 4 and prefill engines (quantisation as released, prefix caching off)."""
    from kvshare.bench.kv_runner import make_engine

    common: dict[str, Any] = {"block_size": 128, "dtype": "bfloat16", "device": "cpu",
                              "enable_prefix_caching": False, "quantize": True, "threads": min(opts.threads)}
    dec_len = opts.prompt_len + opts.new_tokens + 1
    return {"b1": make_engine(model, batch=1, max_len=dec_len, **common),
            "b4": make_engine(model, batch=4, max_len=dec_len, **common),
            "prefill": make_engine(model, batch=1, max_len=opts.prefill_len + 2,
                                   max_batched_tokens=opts.prefill_len, **common)}


def kv_round(engines: dict[str, Any], prompts: dict[str, torch.Tensor], new_tokens: int, tag: str
             ) -> dict[str, Any]:
    """One round of kvshare (the measures of `real_llamacpp.lc_round`)."""
    from kvshare.bench.kv_runner import kv_generate, kv_prefill

    out: dict[str, Any] = {}
    for b in (1, 4):
        res = kv_generate(engines[f"b{b}"], prompts[f"b{b}"], new_tokens, tag=f"{tag}b{b}-")
        out[f"decode_b{b}_tok_s"], out[f"decode_b{b}_step_s"] = res.decode_tps, res.decode.median
        out[f"tokens_b{b}"] = res.tokens
    out["prefill_tok_s"] = prompts["prefill"].shape[1] / kv_prefill(engines["prefill"], prompts["prefill"], 1,
                                                                    tag=f"{tag}p-")
    return out


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for s, t in zip(a, b) for x, y in zip(s, t)]
    return sum(x == y for x, y in pairs) / len(pairs) if pairs else float("nan")


def run_rounds(opts: RealOptions, engines: dict[str, Any], lc_model: Any) -> dict[int, dict[str, list]]:
    """Warm-ups, then `opts.repeats` alternating rounds (module doc); per thread count the raw rounds."""
    from kvshare.bench.gen import equal_length_prompts
    from kvshare.bench.measure import copy_bandwidth, read_bandwidth
    from kvshare.bench.real_llamacpp import lc_round

    v = opts.vocab
    prompts = {"b1": equal_length_prompts(1, opts.prompt_len, v, opts.seed + 1),
               "b4": equal_length_prompts(4, opts.prompt_len, v, opts.seed + 4),
               "prefill": equal_length_prompts(1, opts.prefill_len, v, opts.seed + 512)}
    short = {"b1": prompts["b1"][:, :8], "b4": prompts["b4"][:, :8], "prefill": prompts["prefill"][:, :64]}
    runs: dict[int, dict[str, list]] = {t: {"kvshare": [], "llamacpp": []} for t in opts.threads}
    for t in opts.threads:  # warm-up: first use of each thread pool size, allocator growth, page faults
        torch.set_num_threads(t)
        kv_round(engines, short, 2, f"w{t}")
        if lc_model is not None:
            lc_round(lc_model, t, short, 2)
    for r in range(opts.repeats):
        order = opts.threads if r % 2 == 0 else tuple(reversed(opts.threads))
        for t in order:
            torch.set_num_threads(t)
            copy = copy_bandwidth(opts.copy_mib * 2**20)["read_gbps"]
            read = read_bandwidth(opts.copy_mib * 2**20)
            sides = ["kvshare", "llamacpp"] if (r + t) % 2 == 0 else ["llamacpp", "kvshare"]
            for side in sides:
                if side == "kvshare":
                    runs[t]["kvshare"].append({**kv_round(engines, prompts, opts.new_tokens, f"r{r}t{t}"),
                                               "copy_read_gbps": copy, "sum_read_gbps": read,
                                               "loadavg": os.getloadavg()[0]})
                elif lc_model is not None:
                    runs[t]["llamacpp"].append({**lc_round(lc_model, t, prompts, opts.new_tokens),
                                                "loadavg": os.getloadavg()[0]})
            print(f"round {r + 1}/{opts.repeats}, {t} thread(s): kvshare b1 "
                  f"{runs[t]['kvshare'][-1]['decode_b1_tok_s']:.2f} tok/s, load {os.getloadavg()[0]:.2f}",
                  file=sys.stderr, flush=True)
    return runs


def build_section(opts: RealOptions, cfg: Any, runs: dict[int, dict[str, list]], weight_bytes: int,
                  kv_load: dict[str, Any] | None, lc_load: dict[str, Any] | None, notes: list[str]) -> Section:
    """The one table of both engines (module doc), its targets and notes, and the raw data."""
    from kvshare.bench.real_table import COLUMNS, load_rows, speed_rows, summarise

    ck_bytes = (kv_load or {}).get("checkpoint_bytes")
    size = f"; checkpoint {ck_bytes / 1e9:.2f} GB" if ck_bytes else ""
    sec = Section("real", f"{opts.model} at its real per-layer sizes ({cfg.num_hidden_layers} layers, "
                  f"{cfg.n_routed_experts} routed experts of {cfg.moe_intermediate_size}, top-{cfg.num_experts_per_tok}"
                  f" + 1 shared, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}{size}): kvshare (FP8 / FP4 packed) "
                  + ("vs llama.cpp (MXFP4 experts, Q8_0 from FP8)" if any(runs[t]["llamacpp"] for t in opts.threads)
                     else "alone (llama.cpp did not run, see the notes)"), list(COLUMNS))
    rows, targets = load_rows(kv_load, lc_load)
    summary: dict[int, dict[str, Any]] = {}
    kv_tokens: list[Any] = []
    agree = []
    for t in opts.threads:
        kv, lc = summarise(runs[t]["kvshare"]), summarise(runs[t]["llamacpp"])
        summary[t] = {"kvshare": kv, "llamacpp": lc or None}
        r, tg = speed_rows(t, kv, lc or None, weight_bytes, opts.prefill_len)
        rows += r
        targets += tg
        for k_run in runs[t]["kvshare"]:
            kv_tokens.append((k_run["tokens_b1"], k_run["tokens_b4"]))
        for k_run, l_run in zip(runs[t]["kvshare"], runs[t]["llamacpp"]):
            agree.append(_agreement(k_run["tokens_b1"] + k_run["tokens_b4"], l_run["tokens_b1"] + l_run["tokens_b4"]))
    same = all(x == kv_tokens[0] for x in kv_tokens)
    sec.rows, sec.targets = rows, targets
    sec.notes = list(notes) + [
        f"best of {opts.repeats} alternating rounds per engine and thread count (median in the JSON); decode: "
        f"{opts.new_tokens} tokens after a {opts.prompt_len}-token prompt, tok/s = batch / median step; prefill: "
        f"one {opts.prefill_len}-token prompt to its first token",
        f"weight bytes per batch-1 decode token (kvshare, packed): {weight_bytes / 1e6:.1f} MB",
        "loads in fresh processes; llama.cpp maps the GGUF (its load time is the mapping; the file, just written, "
        "is in the page cache and its mapped pages count in its RSS), kvshare reads and packs; 'incl. an 8-token "
        "generation': the peak growth once a generation has touched the weights",
        f"kvshare greedy tokens identical at every thread count and round: {'yes' if same else 'NO'}",
    ]
    if agree:
        sec.notes.append(f"llama.cpp's greedy tokens equal kvshare's at {100 * sum(agree) / len(agree):.0f}% of "
                         "positions (information only: Q8_0 is not FP8, random weights have small top-2 gaps)")
    sec.data = {"config": cfg.to_dict(), "weight_bytes_per_decode_token": weight_bytes, "summary": summary,
                "runs": {str(t): v for t, v in runs.items()}, "kvshare_load": kv_load, "llamacpp_load": lc_load,
                "kvshare_tokens_identical_over_threads": same}
    return sec


def run_real(opts: RealOptions) -> tuple[list[Section], dict[str, Any], dict[str, Path]]:
    """Run, print and save (module doc); returns (sections, header, written paths)."""
    from kvshare.bench.bandwidth import weight_bytes_per_step
    from kvshare.bench.load_memory import measure_load
    from kvshare.bench.measure import load_note, package_version
    from kvshare.bench.real_llamacpp import measure_lc_load, own_src_env, released_gguf
    from kvshare.weights.loader import load_model

    opts = opts.resolved()
    threads_before = torch.get_num_threads()
    header: dict[str, Any] = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "command": opts.command(),
        "which": "real", "device": "cpu", "dtype": "bfloat16", "threads": list(opts.threads),
        "python": platform.python_version(), "torch": package_version("torch"),
        "llama-cpp-python": package_version("llama-cpp-python"), "transformers": "not used", "machine": platform.machine(),
        "load_before": load_note(), "options": {k: str(v) for k, v in asdict(opts).items()}}
    t_start = time.perf_counter()
    lc_model = None
    try:
        with tempfile.TemporaryDirectory(prefix="kvshare-real-") as tmp:
            ck, cfg, ck_note = prepare_checkpoint(opts, Path(tmp))
            opts.vocab = cfg.vocab_size
            notes = [ck_note]
            kv_load = measure_load(ck, new_tokens=8, threads=max(opts.threads), env=own_src_env())
            kv_load["generate_peak_growth_bytes"] = kv_load["peak_after_generate_bytes"] - kv_load["rss_before_bytes"]
            lc_load = None
            if not opts.llamacpp:
                notes.append("llama.cpp: not requested (--no-llamacpp)")
            else:
                gguf, note = released_gguf(ck, cfg, opts.fetch)
                notes.append(note)
                if gguf is not None:
                    lc_load = measure_lc_load(gguf, max(opts.threads), cfg.vocab_size)
                    from kvshare.bench.llamacpp_peer import LlamaCppModel

                    lc_model = LlamaCppModel(gguf, "released")
            model = load_model(ck, dtype=torch.bfloat16, quant=True)
            weight_bytes = weight_bytes_per_step(model, cfg.n_routed_experts, cfg.num_experts_per_tok, 1)
            engines = kv_engines(model, opts)
            runs = run_rounds(opts, engines, lc_model)
            sec = build_section(opts, cfg, runs, weight_bytes, kv_load, lc_load, notes)
    finally:
        if lc_model is not None:
            lc_model.close()
        torch.set_num_threads(threads_before)
    header["load_after"] = load_note()
    header["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    header["errors"] = {}
    print_sections([sec], header)
    paths = save([sec], header, opts.out_dir, opts.name)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return [sec], header, paths
