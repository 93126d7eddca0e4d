"""V4.1 cross-layer KV sharing at V4.1-Flash's real per-layer sizes: KV bytes per token and decode step
time at 1K / 8K / 32K tokens of context, sharing on vs off (issue 37 item 3's table).

Not part of the test suite (minutes to hours on a small machine). The model: `real_config('v4.1-flash',
--layers, --experts)` (hidden 5120, 64 heads of 512, q/o LoRA 1280 / 1024, experts of 2304, index heads
32 x 128, candidate top-2048 blocks of 8; fewer layers with V4.1's ratio / source pattern, no Engram, no
drafter), written in the release's formats (`write_released_checkpoint`) and loaded with `load_model`
(bf16, FP8 / FP4 kept packed) and served as released (quantisation on: FP8 activations, the FP8 / FP4
cache formats), prefix caching off. Per context and mode: one sequence is prefilled to the context, then
`--steps` decode steps are timed, the two modes' steps alternating (`kv_decode_interleaved`); the
median is reported. KV bytes per token: the engine's pool layout (what a token costs across all layers,
every cache region included), and the planner's figure for the full 40-layer V4.1-Flash config
(`kvshare plan` arithmetic, no model needed).

    PYTHONPATH=src python benchmarks/v41_sharing_real.py --layers 6 --experts 8 --contexts 1024,8192,32768 --threads 1

On a shared machine pass ``--threads`` no larger than the idle cores (or export ``OMP_WAIT_POLICY=PASSIVE``
before starting): OpenMP's threads spin at every barrier, and a spinning thread takes the core another
kvshare thread needs. On the 2-core development machine at load ~3.5, two threads made decode steps of
this model 2.1 s instead of 0.19 s on one (and 0.2 s on two with ``OMP_WAIT_POLICY=PASSIVE``); the first
run of this table (9.5 s steps, ~290 s per 1K tokens of prefill, two threads at load 7-9) was that.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch


def full_model_bytes_per_token() -> dict[str, int]:
    """The planner's cache bytes per token of the full V4.1-Flash config (bf16 engine, block 128)."""
    from kvshare.config import load_config
    from kvshare.engine.args import EngineArgs
    from kvshare.engine.cache_plan import cache_plan
    from kvshare.topology import Topology

    cfg = load_config("deepseek-v4.1-flash")
    out = {}
    for share in (True, False):
        plan = cache_plan(cfg, Topology(cfg, share_cache=share), EngineArgs(block_size=128, share_kv_cache=share))
        out["on" if share else "off"] = int(plan.layout.bytes_per_token)
    return out


def main() -> None:
    from kvshare.bench.gen import equal_length_prompts
    from kvshare.bench.kv_runner import blocks_needed, engine_layout, kv_decode_interleaved, kv_prefill
    from kvshare.engine.engine import LLMEngine
    from kvshare.bench.real_checkpoint import real_config, write_released_checkpoint
    from kvshare.weights.loader import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=1024, help="prefill tokens per step")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--checkpoint", default=None, help="reuse (or write) the checkpoint here")
    ap.add_argument("--out", default="benchmarks/results/v41-sharing-real.json")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = real_config("v4.1-flash", a.layers, a.experts)
    ck = Path(a.checkpoint or tempfile.mkdtemp(prefix="v41-real-"))
    if not (ck / "model.safetensors").is_file():
        write_released_checkpoint(cfg, ck)
    model = load_model(ck, dtype=torch.bfloat16, quant=False)
    rows = []
    result = {"layers": a.layers, "experts": a.experts, "threads": torch.get_num_threads(),
              "loadavg_before": os.getloadavg()[0], "full_v41_flash_bytes_per_token": full_model_bytes_per_token(),
              "config": {"compress_ratios": list(cfg.compress_ratios), "kv_sources": list(cfg.kv_source_layer_ids),
                         "index_sources": list(cfg.index_source_layer_ids)}, "contexts": rows}
    for ctx in (int(c) for c in a.contexts.split(",")):
        prompt = equal_length_prompts(1, ctx, cfg.vocab_size, 7)
        engines, entry = [], {"context": ctx}
        for share in (True, False):
            eng = LLMEngine(model, block_size=128, max_num_seqs=1, max_model_len=ctx + a.steps + 4,
                            max_num_batched_tokens=a.chunk, num_blocks=blocks_needed(1, ctx + a.steps + 4, 128),
                            dtype="bfloat16", device="cpu", share_kv_cache=share, quantize=True,
                            enable_prefix_caching=False)
            t0 = time.perf_counter()
            kv_prefill(eng, prompt, a.steps + 2)
            mode = "on" if share else "off"
            entry[f"prefill_s_{mode}"] = time.perf_counter() - t0
            entry[f"bytes_per_token_{mode}"] = int(engine_layout(eng).bytes_per_token)
            engines.append(eng)
        on, off = kv_decode_interleaved(engines, a.steps)
        entry.update(step_ms_on=on.median * 1e3, step_ms_off=off.median * 1e3, loadavg=os.getloadavg()[0])
        rows.append(entry)
        del engines
        print(json.dumps(entry), flush=True)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)  # after every context: a partial run keeps its rows
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print("| context | KV B/token on | off | off/on | step ms on | step ms off | off/on |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['bytes_per_token_on']} | {r['bytes_per_token_off']} | "
              f"{r['bytes_per_token_off'] / r['bytes_per_token_on']:.2f} | {r['step_ms_on']:.1f} | "
              f"{r['step_ms_off']:.1f} | {r['step_ms_off'] / r['step_ms_on']:.2f} |")
    full = result["full_v41_flash_bytes_per_token"]
    print(f"full V4.1-Flash (40 layers, planner): {full['on']} B/token on, {full['off']} off "
          f"({full['off'] / full['on']:.2f}x)")


if __name__ == "__main__":
    main()
