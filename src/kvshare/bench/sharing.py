"""Sharing on vs off for a V4.1-shaped model (``EngineArgs.share_kv_cache`` True / False).

Per mode:

* cache bytes per token of the engine's block pool, asserted equal to the planner's
  (`kvshare plan`, i.e. ``kvshare.engine.cache_plan.cache_plan`` from the config alone) for the same formats and block size,
  and the on/off ratio asserted equal to the planner's saving factor;
* the largest number of concurrent sequences of `sharing_context` tokens that fit in a pool of
  `pool_mib` MiB: the planner's answer (per-sequence rings are reserved per sequence slot, then
  whole blocks), checked against the blocks the engine actually allocates for that budget;
* the prefill time, and the median decode step time of `sharing_batch` sequences at
  `sharing_context` tokens (the two engines' steps timed alternately);
* the same pool filled to capacity (max sequences of each mode): step time and decode tokens/s,
  i.e. what the saved bytes buy when memory bounds the batch.
"""

from __future__ import annotations

import math
from typing import Any

from kvshare.bench.gen import equal_length_prompts
from kvshare.bench.kv_runner import engine_layout, kv_decode_interleaved, kv_generate, kv_prefill, make_engine
from kvshare.bench.report import Section, Target
from kvshare.bench.sizes import BenchSizes, v41_config
from kvshare.config import load_config
from kvshare.engine.args import EngineArgs
from kvshare.engine.cache_plan import cache_plan
from kvshare.topology import Topology

TARGET_STEP_RATIO = 0.85


def planner(cfg_dict: dict[str, Any], block_size: int, layout: Any, share: bool, memory: int | None = None,
            max_seqs: int = 1) -> dict[str, Any]:
    """`kvshare plan`'s numbers (`cache_plan`, from the config alone) for this config, formats and
    block size."""
    cfg = load_config(cfg_dict)
    args = EngineArgs(block_size=block_size, share_kv_cache=share,
                      kv_format=(layout.kv_format.name, layout.index_format.name, layout.window_format.name))
    return cache_plan(cfg, Topology(cfg), args).layout.to_dict(memory, max_seqs)


def max_sequences(cfg_dict: dict[str, Any], block_size: int, layout: Any, share: bool, memory: int,
                  context: int) -> int:
    """Largest n such that n sequences of `context` tokens fit in `memory` bytes (planner arithmetic)."""
    per_seq = math.ceil(context / block_size)
    best, n = 0, 1
    while True:
        plan = planner(cfg_dict, block_size, layout, share, memory, n)["memory"]
        usable = max(0, plan["blocks"] - 1)  # block 0 is the null block
        if usable < n * per_seq:
            return best
        best, n = n, n + 1
        if n > 1_000_000:
            return best


def config_bytes_per_token(cfg_dict: dict[str, Any], kv_row: int, ik_row: int, share: bool) -> float:
    """Compressed-cache bytes per token from the config's source lists alone (spec/cache.md §4.4).

    Shared: each kv source keeps kv_row / ratio and each index-K owner ik_row / ratio; unshared:
    every compressed layer keeps both. Independent of CacheLayout (no padding: the bench's block
    sizes make every region a multiple of the alignment).
    """
    n = cfg_dict["num_hidden_layers"]
    ratios = cfg_dict["compress_ratios"][:n]
    compressed = [layer for layer in range(n) if ratios[layer]]
    kv = cfg_dict["kv_source_layer_ids"] if share else compressed
    ik = (cfg_dict.get("index_k_source_layer_ids") or cfg_dict["kv_source_layer_ids"]) if share else compressed
    return sum(kv_row / ratios[layer] for layer in kv) + sum(ik_row / ratios[layer] for layer in ik)


def engine_blocks(engine: Any) -> int:
    """Usable blocks of the engine's pool (the null block excluded)."""
    return int(engine.stats().num_blocks_total)


def sharing_section(s: BenchSizes, model_for: Any, *, dtype: str, device: str) -> Section:
    """Run both modes; `model_for(share)` returns the model to serve with that mode."""
    cfg_dict = v41_config(s)
    ctx, b = s.sharing_context, s.sharing_batch
    memory = s.pool_mib * 2**20
    sec = Section("sharing", f"Cross-layer KV sharing on vs off, V4.1-shaped {s.v41_layers} layers, "
                  f"{b} sequences x {ctx} tokens, pool {s.pool_mib} MiB",
                  ["mode", "cache B/token", "planner B/token", "max seqs @ctx in pool", "prefill s",
                   f"decode step ms ({b} seqs)", "full-pool step ms", "full-pool decode tok/s"])
    modes: dict[str, dict[str, Any]] = {}
    engines: list[Any] = []
    full_engines: list[Any] = []
    prompts = equal_length_prompts(b, ctx, s.vocab, s.seed + 7)
    for share in (True, False):
        model = model_for(share)
        engine = make_engine(model, batch=b, max_len=ctx + s.context_steps + 2, block_size=s.block_size,
                             dtype=dtype, device=device, share_kv_cache=share,
                             max_batched_tokens=min(b * ctx, s.prefill_chunk))
        kv_generate(engine, prompts[:, : min(ctx, 32)], 2, device, tag="w")  # warm-up
        prefill_s = kv_prefill(engine, prompts, s.context_steps + 2, device)
        layout = engine_layout(engine)
        plan = planner(cfg_dict, s.block_size, layout, share)
        assert layout.bytes_per_token == plan["bytes_per_token"], (
            f"engine {layout.bytes_per_token} B/token != planner {plan['bytes_per_token']} (share={share})")
        n_max = max_sequences(cfg_dict, s.block_size, layout, share, memory, ctx)
        check = make_engine(model, batch=max(n_max, 1), max_len=ctx + s.context_steps + 2, block_size=s.block_size,
                            dtype=dtype, device=device, share_kv_cache=share, memory_bytes=memory,
                            max_batched_tokens=4 * s.prefill_chunk)
        blocks = engine_blocks(check)
        assert blocks >= n_max * math.ceil(ctx / s.block_size), (
            f"engine pool of {blocks} blocks holds fewer than {n_max} sequences")
        modes["on" if share else "off"] = {
            "bytes_per_token": layout.bytes_per_token, "planner": plan, "max_seqs": n_max,
            "engine_blocks_for_pool": blocks, "prefill_s": prefill_s, "layout_id": layout.layout_id}
        engines.append(engine)
        full = equal_length_prompts(n_max, ctx, s.vocab, s.seed + 11)
        modes["on" if share else "off"]["full_pool_prefill_s"] = kv_prefill(check, full, s.context_steps + 2, device)
        full_engines.append(check)
    for mode, t in zip(("on", "off"), kv_decode_interleaved(engines, s.context_steps, device)):
        modes[mode].update(decode=t.as_dict(), step_s=t.median)
    del engines
    for mode, t in zip(("on", "off"), kv_decode_interleaved(full_engines, s.context_steps, device)):
        m = modes[mode]
        m.update(full_pool_decode=t.as_dict(), full_pool_step_s=t.median,
                 full_pool_tok_s=m["max_seqs"] / t.median, full_pool_s_per_token=t.median / m["max_seqs"])
    del full_engines
    for mode in ("on", "off"):
        m = modes[mode]
        sec.rows.append([f"sharing {mode}", m["bytes_per_token"], m["planner"]["bytes_per_token"], m["max_seqs"],
                         m["prefill_s"], m["step_s"] * 1e3, m["full_pool_step_s"] * 1e3, m["full_pool_tok_s"]])
    on, off = modes["on"], modes["off"]
    factor = off["bytes_per_token"] / on["bytes_per_token"]
    planner_factor = on["planner"]["saving_factor"]
    assert math.isclose(factor, planner_factor, rel_tol=1e-12), f"on/off {factor} != planner {planner_factor}"
    rows = (layout.kv_format.row_bytes, layout.index_format.row_bytes)
    config_factor = config_bytes_per_token(cfg_dict, *rows, False) / config_bytes_per_token(cfg_dict, *rows, True)
    sec.rows.append(["ratio off/on", factor, planner_factor, off["max_seqs"] and on["max_seqs"] / off["max_seqs"],
                     off["prefill_s"] / on["prefill_s"], off["step_s"] / on["step_s"],
                     off["full_pool_step_s"] / on["full_pool_step_s"], on["full_pool_tok_s"] / off["full_pool_tok_s"]])
    sec.data = {"modes": modes, "bytes_factor": factor, "planner_factor": planner_factor,
                "config_factor": config_factor, "context": ctx, "batch": b, "pool_bytes": memory}
    sec.targets.append(Target("engine bytes/token off / on = the config's entry count", factor, config_factor, "=="))
    sec.targets.append(Target(f"decode step on / off, {b} sequences each", on["step_s"] / off["step_s"],
                              TARGET_STEP_RATIO, "<="))
    sec.targets.append(Target("decode time per token on / off, pool filled to capacity",
                              on["full_pool_s_per_token"] / off["full_pool_s_per_token"], TARGET_STEP_RATIO, "<="))
    sec.notes.append("ratio row: bytes and times are off/on; max seqs and full-pool tok/s are on/off. Decode "
                     "steps of the two engines are timed alternately (one step each in turn). Full pool: each mode "
                     "serves as many sequences as its pool holds (max seqs) at the same context.")
    sec.plot = _plot
    return sec


def _plot(ax: Any, s: Section) -> None:
    m = s.data["modes"]
    names = ["B/token", "max seqs", "step ms\n(equal batch)", "decode tok/s\n(full pool)"]
    keys = [("bytes_per_token", 1), ("max_seqs", 1), ("step_s", 1e3), ("full_pool_tok_s", 1)]
    on = [m["on"][k] * f for k, f in keys]
    off = [m["off"][k] * f for k, f in keys]
    rel_on = [a / b if b else 0 for a, b in zip(on, off)]
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [1.0] * len(names), width=0.4, label="sharing off (=1)")
    ax.bar([x + 0.2 for x in xs], rel_on, width=0.4, label="sharing on")
    for x, r, v in zip(xs, rel_on, on):
        ax.annotate(f"{r:.2f}x\n({v:,.0f})", (x + 0.2, r), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("relative to sharing off")
    ax.legend(fontsize=8)

