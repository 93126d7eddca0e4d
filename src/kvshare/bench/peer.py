"""Peer comparison: kvshare's paged engine vs transformers' `DeepseekV4ForCausalLM.generate`.

Same V4 weights (kvshare's seeded random init, renamed for transformers), same equal-length
random prompts, greedy decoding of the same number of tokens, quantisation off and the same
dtype on both sides. Each side gets a short warm-up generation first. Per batch size the table
gives prefill tokens/s, decode tokens/s, time per output token, the peak memory the run added
(kvshare: engine construction incl. its block pool + the run; transformers: the run incl. its
DynamicCache; the weights are resident for both and listed separately), whether the generated
tokens are identical, and the kvshare / transformers ratios. With repeats the two engines' runs
alternate, and each engine reports its fastest prefill and its fastest decode over its runs.

With ``llama-cpp-python`` installed, llama.cpp runs beside them on GGUFs of the same weights (the
checkpoint dtype and q8_0, `kvshare.bench.llamacpp_peer`), in the same alternation; its tokens
are compared with kvshare's (sequences identical, first differing position per sequence).
"""

from __future__ import annotations

from typing import Any

import torch

from kvshare.bench.gen import GenResult, best_of, compare_tokens, equal_length_prompts
from kvshare.bench.kv_runner import DTYPES, build_model, kv_run
from kvshare.bench.llamacpp_peer import lc_generate, lc_warmup, llamacpp_peers
from kvshare.bench.report import Section, Target
from kvshare.bench.sizes import BenchSizes, peer_v4_config
from kvshare.config import ModelConfig

TARGET_DECODE_RATIO = 3.0
TARGET_DECODE_RATIO_B1 = 1.5
TARGET_PREFILL_RATIO = 2.0


def _row(r: GenResult, same: Any) -> list[Any]:
    return [r.batch, r.engine, r.prefill_tps, r.decode_tps, r.tpot_ms, r.memory.get("delta_rss", 0) / 2**20, same]


def llamacpp_rows(kv: GenResult, runs: dict[str, list[GenResult]], entry: dict[str, Any],
                  rows: list[list[Any]]) -> None:
    """Per llama.cpp GGUF: its best run as a row, tokens compared with kvshare's, and the
    kvshare / llama.cpp ratio row; the same facts go into `entry["llamacpp"]`."""
    entry["llamacpp"] = {}
    for label, lc_runs in runs.items():
        best = best_of(lc_runs)
        cmp = compare_tokens(kv.tokens, best.tokens)
        ratio = {"prefill": kv.prefill_tps / best.prefill_tps, "decode": kv.decode_tps / best.decode_tps,
                 "tpot": kv.tpot_ms / best.tpot_ms}
        entry["llamacpp"][label] = {"result": best.as_dict(), "all_decode_tok_s": [r.decode_tps for r in lc_runs],
                                    "all_prefill_s": [r.prefill_s for r in lc_runs], "tokens_vs_kvshare": cmp,
                                    "ratio": ratio,
                                    "repeat_tokens_stable": all(r.tokens == best.tokens for r in lc_runs)}
        rows.append(_row(best, f"{cmp['sequences_identical']}/{cmp['sequences']} vs kvshare"))
        rows.append([kv.batch, f"kvshare/llama.cpp {label}", ratio["prefill"], ratio["decode"], ratio["tpot"], "", ""])


def peer_section(s: BenchSizes, *, dtype: str, device: str, with_peer: bool = True,
                 with_llamacpp: bool = True, fetch: bool = True) -> tuple[Section, dict[str, Any]]:
    """Run the comparison; returns the section and kvshare's per-batch results (for bandwidth)."""
    cfg = ModelConfig.from_dict(peer_v4_config(s))
    model = build_model(cfg, s.seed, DTYPES[dtype], device)
    with llamacpp_peers(model, cfg, dtype, device, with_llamacpp, fetch) as (lc_models, lc_note):
        return _peer_section(s, cfg, model, lc_models, lc_note, dtype=dtype, device=device, with_peer=with_peer)


def _peer_section(s: BenchSizes, cfg: ModelConfig, model: Any, lc_models: list[Any], lc_note: str, *,
                  dtype: str, device: str, with_peer: bool) -> tuple[Section, dict[str, Any]]:
    n_params = sum(p.numel() for p in model.parameters())
    hf = None
    if with_peer:
        from kvshare.bench.hf_peer import build_hf_model, hf_generate, hf_warmup

        hf = build_hf_model(cfg, model.state_dict(), DTYPES[dtype], device)
    peers = " and ".join((["transformers"] if hf is not None else []) + (["llama.cpp"] if lc_models else []))
    sec = Section("peer", f"kvshare vs {peers or 'no peer'}, V4 {s.peer_layers} layers (ratios "
                  f"{'/'.join(map(str, cfg.compress_ratios[:cfg.num_hidden_layers]))}), hidden {s.hidden}, "
                  f"{n_params / 1e6:.1f}M params, {dtype}, prompt {s.prompt_len}, {s.new_tokens} new tokens",
                  ["batch", "engine", "prefill tok/s", "decode tok/s", "TPOT ms", "peak +MiB", "tokens identical"])
    kv_results: dict[str, Any] = {}
    runs: list[dict[str, Any]] = []
    for b in s.batches:
        prompts = equal_length_prompts(b, s.prompt_len, s.vocab, s.seed + b)
        kv_runs: list[GenResult] = []
        hf_runs: list[GenResult] = []
        lc_runs: dict[str, list[GenResult]] = {m.label: [] for m in lc_models}
        engine: Any = None
        for rep in range(max(1, s.repeats)):  # alternate the engines; keep each one's fastest run
            res, eng = kv_run(model, prompts, s.new_tokens, block_size=s.block_size, dtype=dtype, device=device,
                              warmup=rep == 0)
            kv_runs.append(res)
            engine = eng  # only its cache layout is used later (bandwidth)
            if hf is not None:
                if rep == 0:
                    hf_warmup(hf, prompts, device)
                hf_runs.append(hf_generate(hf, prompts, s.new_tokens, device))
            for m in lc_models:
                if rep == 0:
                    lc_warmup(m, prompts, torch.get_num_threads())
                lc_runs[m.label].append(lc_generate(m, prompts, s.new_tokens, torch.get_num_threads()))
        kv = best_of(kv_runs)
        kv_results[str(b)] = {"result": kv, "engine": engine}
        entry: dict[str, Any] = {"batch": b, "kvshare": kv.as_dict(),
                                 "kvshare_all_decode_tok_s": [r.decode_tps for r in kv_runs],
                                 "kvshare_all_prefill_s": [r.prefill_s for r in kv_runs],
                                 "repeat_tokens_stable": all(r.tokens == kv.tokens for r in kv_runs)}
        if hf is not None:
            ref = best_of(hf_runs)
            entry["transformers_all_decode_tok_s"] = [r.decode_tps for r in hf_runs]
            entry["transformers_all_prefill_s"] = [r.prefill_s for r in hf_runs]
            entry["repeat_tokens_stable"] &= all(r.tokens == ref.tokens for r in hf_runs)
            cmp = compare_tokens(kv.tokens, ref.tokens)
            entry.update(transformers=ref.as_dict(), tokens=cmp)
            same = f"{cmp['sequences_identical']}/{cmp['sequences']}"
            sec.rows.append(_row(kv, same))
            sec.rows.append(_row(ref, same))
            ratio = {"prefill": kv.prefill_tps / ref.prefill_tps, "decode": kv.decode_tps / ref.decode_tps,
                     "tpot": kv.tpot_ms / ref.tpot_ms}
            entry["ratio"] = ratio
            sec.rows.append([b, "kvshare/tf", ratio["prefill"], ratio["decode"], ratio["tpot"],
                             "", "yes" if cmp["identical"] else "NO"])
        else:
            sec.rows.append(_row(kv, "n/a"))
        if lc_runs:
            llamacpp_rows(kv, lc_runs, entry, sec.rows)
        runs.append(entry)
        del engine
    sec.data = {"config": cfg.to_dict(), "params": n_params,
                "weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters()), "runs": runs}
    big = max(s.batches)
    last = next((r for r in runs if r["batch"] == big and "ratio" in r), None)
    if last is not None:
        sec.targets.append(Target(f"decode tok/s at batch {big}, kvshare / transformers",
                                  last["ratio"]["decode"], TARGET_DECODE_RATIO, ">="))
        sec.targets.append(Target(f"prefill tok/s at batch {big}, kvshare / transformers",
                                  last["ratio"]["prefill"], TARGET_PREFILL_RATIO, ">="))
    first = next((r for r in runs if r["batch"] == 1 and "ratio" in r), None)
    if first is not None:
        sec.targets.append(Target("decode tok/s at batch 1, kvshare / transformers",
                                  first["ratio"]["decode"], TARGET_DECODE_RATIO_B1, ">="))
    sec.notes.append(f"weights: {sec.data['weights_bytes'] / 2**20:.0f} MiB per engine (not in 'peak +MiB'); "
                     f"best of {max(1, s.repeats)} alternating runs per engine (prefill and decode each)")
    sec.notes.append(lc_note)
    for r in runs:
        for label, lc in r.get("llamacpp", {}).items():
            sec.notes.append(f"batch {r['batch']}, llama.cpp {label} vs kvshare: first differing token per sequence "
                             f"{lc['tokens_vs_kvshare']['first_divergence']} (None: identical)")
    sec.plot = _plot
    kv_results["model"] = model
    kv_results["cfg"] = cfg
    return sec, kv_results


def _plot(ax: Any, s: Section) -> None:
    runs = s.data["runs"]
    xs = list(range(len(runs)))
    kv = [r["kvshare"]["decode_tok_s"] for r in runs]
    ax.bar([x - 0.2 for x in xs], kv, width=0.4, label="kvshare")
    if runs and "transformers" in runs[0]:
        tf = [r["transformers"]["decode_tok_s"] for r in runs]
        ax.bar([x + 0.2 for x in xs], tf, width=0.4, label="transformers")
        for x, r in zip(xs, runs):
            ax.annotate(f"{r['ratio']['decode']:.2f}x", (x, max(r['kvshare']['decode_tok_s'],
                        r['transformers']['decode_tok_s'])), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(xs, [f"batch {r['batch']}" for r in runs])
    ax.set_ylabel("decode tokens/s")
    ax.legend()
