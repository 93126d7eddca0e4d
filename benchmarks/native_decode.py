"""Native decode kernels on / off, side by side in one process (issue 26 part 2).

The bench's peer V4 model (`kvshare bench peer` sizes, bf16, batch-invariant default, 1 thread):
for each batch, two engines hold the same prompts; their decode steps alternate, one with the
native decode kernels (`kvshare.kernels.decode`) and one with the torch path, so load changes on
this shared machine hit both alike. Prefill of each mode is timed alternately too. Reports best and
median step time and decode tok/s per mode, prefill tok/s (best of `--repeats`), whether both
modes generated the same tokens, and with ``--profile`` the top ops by self CPU time and torch
calls per decode step of each mode.

    PYTHONPATH=src python benchmarks/native_decode.py [--batches 1,8] [--steps 24] [--profile]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvshare.bench.gen import equal_length_prompts
from kvshare.bench.kv_runner import build_model, greedy, make_engine
from kvshare.bench.sizes import FULL, peer_v4_config
from kvshare.config import ModelConfig


def _prefill(model, prompts, steps: int, on: bool):
    """An engine with `prompts` added and prefilled with the native kernels `on` or off; (engine, seconds)."""
    b, n = prompts.shape
    eng = make_engine(model, batch=b, max_len=n + steps + 8, block_size=FULL.block_size, dtype="bfloat16", device="cpu")
    model.bind(model.kernels.with_(native=on))  # (the engine bound it to the default choice)
    for i, p in enumerate(prompts.tolist()):
        eng.add_request(str(i), p, greedy(steps + 1))
    t0 = time.perf_counter()
    eng.step()
    return eng, time.perf_counter() - t0


def _profile(eng, on: bool, steps: int = 4) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            eng.step()
    ka = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return {"torch_calls_per_step": sum(e.count for e in ka) / steps,
            "self_cpu_ms_per_step": sum(e.self_cpu_time_total for e in ka) / steps / 1e3,
            "top": [(e.key, round(e.self_cpu_time_total / steps / 1e3, 3), e.count // steps) for e in ka[:12]]}


def run(batch: int, steps: int, repeats: int, prof: bool) -> dict:
    torch.set_num_threads(1)
    cfg = ModelConfig.from_dict(peer_v4_config(FULL))
    models = {on: build_model(cfg, FULL.seed, torch.bfloat16) for on in (False, True)}  # one binding each
    prompts = equal_length_prompts(batch, FULL.prompt_len, FULL.vocab, FULL.seed + batch)
    pre = {True: [], False: []}
    for _ in range(repeats):
        for on in (False, True):
            pre[on].append(_prefill(models[on], prompts, steps, on)[1])
    engines = {on: _prefill(models[on], prompts, steps + (8 if prof else 0), on)[0] for on in (False, True)}
    for e in engines.values():  # warm-up step each
        e.step()
    times = {True: [], False: []}
    tokens: dict[bool, dict[str, list[int]]] = {True: {}, False: {}}
    for _ in range(steps - 1):
        for on in (False, True):
            t0 = time.perf_counter()
            outs = engines[on].step()
            times[on].append(time.perf_counter() - t0)
            tokens[on].update({o.request_id: list(o.token_ids) for o in outs})
    out = {"batch": batch}
    for on in (False, True):
        name = "native" if on else "torch"
        ts = times[on]
        out[name] = {"best_step_ms": min(ts) * 1e3, "median_step_ms": statistics.median(ts) * 1e3,
                     "decode_tok_s_best": batch / min(ts), "decode_tok_s_median": batch / statistics.median(ts),
                     "prefill_tok_s_best": batch * FULL.prompt_len / min(pre[on])}
        if prof:
            out[name]["profile"] = _profile(engines[on], on)
    out["same_tokens"] = tokens[True] == tokens[False] and len(tokens[True]) == batch
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    res = [run(int(b), a.steps, a.repeats, a.profile) for b in a.batches.split(",")]
    load = Path("/proc/loadavg").read_text().split()[0]
    for r in res:
        t, n = r["torch"], r["native"]
        print(f"batch {r['batch']}: decode tok/s best torch {t['decode_tok_s_best']:.1f} native "
              f"{n['decode_tok_s_best']:.1f} ({n['decode_tok_s_best'] / t['decode_tok_s_best']:.2f}x); median "
              f"{t['decode_tok_s_median']:.1f} / {n['decode_tok_s_median']:.1f}; prefill tok/s best "
              f"{t['prefill_tok_s_best']:.0f} / {n['prefill_tok_s_best']:.0f}; same tokens {r['same_tokens']}")
        if a.profile:
            for name in ("torch", "native"):
                p = r[name]["profile"]
                print(f"  {name}: {p['torch_calls_per_step']:.0f} torch calls/step, {p['self_cpu_ms_per_step']:.1f} ms "
                      f"self CPU/step; top: " + ", ".join(f"{k} {ms}ms x{c}" for k, ms, c in p["top"][:8]))
    print(f"load average {load}")
    if a.out:
        Path(a.out).write_text(json.dumps({"results": res, "load": load}, indent=1))


if __name__ == "__main__":
    main()
