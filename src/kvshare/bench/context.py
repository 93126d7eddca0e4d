"""Context scaling: decode step time of a V4.1-shaped model at growing contexts, vs dense attention.

For each context C one sequence's prompt of C tokens is prefilled through its own paged engine
(in chunks of `prefill_chunk` tokens); then `context_steps` decode steps of every context are
timed, one step per context in turn (so load changes on a shared machine hit all contexts
alike), and the median is kept. Contexts are prefilled in ascending order within
`context_budget_s` seconds: the next context's prefill time is predicted from the measured ones
(a quadratic through the last three points; prefill has a quadratic indexer term) and a context
predicted to overrun the budget is skipped and reported. Next to it: the time dense attention
alone would take per decode step at C (every layer over all C positions, same head shapes;
`kvshare.bench.dense`). The sparse path should stay near-flat (its attention reads top-k entries
plus the window; only the indexer scores grow with C), while dense attention grows linearly.
"""

from __future__ import annotations

from typing import Any

import torch

from kvshare.bench.dense import dense_attention_step
from kvshare.bench.gen import equal_length_prompts
from kvshare.bench.kv_runner import DTYPES, engine_layout, kv_decode_interleaved, kv_generate, kv_prefill, make_engine
from kvshare.bench.measure import now
from kvshare.bench.report import Section, Target
from kvshare.bench.sizes import BenchSizes

TARGET_FLATNESS = 1.3  # issue 11 (phase 2); phase 1 asked for 1.5


def context_section(s: BenchSizes, model: torch.nn.Module, *, dtype: str, device: str) -> Section:
    """Measure every context in `s.contexts` (ascending)."""
    cfg = model.cfg
    contexts = sorted(s.contexts)
    sec = Section("context", f"Decode step vs context, V4.1-shaped {s.v41_layers} layers, hidden {s.hidden}, "
                  f"batch 1, index top-{cfg.index_topk}, {cfg.candidate_topk_blocks}x{cfg.candidate_block_size} "
                  f"candidates, window {cfg.sliding_window}",
                  ["context", "prefill s", "decode step ms", "vs first", "dense attn ms", "dense-engine est. ms",
                   "est. vs first"])
    rows: list[dict[str, Any]] = []
    engines: list[Any] = []
    skipped: list[tuple[int, float]] = []
    t_section = now(device)
    for c in contexts:
        if rows:
            pred = predict_seconds([(r["context"], r["prefill_s"]) for r in rows], c)
            if now(device) - t_section + pred > s.context_budget_s:
                skipped.append((c, pred))
                continue
        prompts = equal_length_prompts(1, c, s.vocab, s.seed + c)
        engine = make_engine(model, batch=1, max_len=c + s.context_steps + 2, block_size=s.block_size,
                             dtype=dtype, device=device, max_batched_tokens=min(c, s.prefill_chunk))
        if not rows:  # warm-up on the first (smallest) context's engine
            kv_generate(engine, prompts[:, : min(c, 64)], 2, device, tag="w")
        prefill_s = kv_prefill(engine, prompts, s.context_steps + 2, device)
        layout = engine_layout(engine)
        rows.append({"context": c, "prefill_s": prefill_s, "bytes_per_token": layout.bytes_per_token,
                     "state_bytes_per_seq": layout.state_bytes_per_seq})
        engines.append(engine)
    for r, t in zip(rows, kv_decode_interleaved(engines, s.context_steps, device)):
        r.update(step_s=t.median, decode=t.as_dict())
    del engines
    for r in rows:
        dense = dense_attention_step(1, cfg.num_attention_heads, cfg.head_dim, r["context"], cfg.num_hidden_layers,
                                     DTYPES[dtype], device, repeats=max(3, s.context_steps))
        r["dense_attention_s"] = dense.median
    base, dbase = rows[0]["step_s"], rows[0]["dense_attention_s"]
    for r in rows:
        r["dense_engine_est_s"] = base + r["dense_attention_s"] - dbase
        sec.rows.append([r["context"], r["prefill_s"], r["step_s"] * 1e3, r["step_s"] / base,
                         r["dense_attention_s"] * 1e3, r["dense_engine_est_s"] * 1e3, r["dense_engine_est_s"] / base])
    sec.data = {"rows": rows, "config": cfg.to_dict(), "skipped": [{"context": c, "predicted_s": p} for c, p in skipped],
                "budget_s": s.context_budget_s}
    for c, p in skipped:
        sec.notes.append(f"context {c} skipped: predicted {p:.0f} s would overrun the {s.context_budget_s} s budget "
                         "(--context-budget-s)")
    last = rows[-1]
    sec.targets.append(Target(f"decode step {last['context']} / {rows[0]['context']} tokens",
                              last["step_s"] / base, TARGET_FLATNESS, "<="))
    sec.notes.append("dense attn = SDPA or matmul-softmax (the faster) over the whole context in every layer, "
                     "attention only (no projections); dense-engine est. = kvshare's step at the first context + "
                     "the growth of dense attention since then")
    sec.plot = _plot
    return sec


def predict_seconds(points: list[tuple[int, float]], c: int) -> float:
    """Run time at context `c` from measured (context, seconds): a quadratic through the last three
    points when there are three, else seconds scaled by (c / c_last)^2 (an upper estimate)."""
    if len(points) >= 3:
        import numpy as np

        xs, ys = zip(*points[-3:])
        coef = np.polyfit(np.array(xs, dtype=float), np.array(ys, dtype=float), 2)
        est = float(np.polyval(coef, c))
        if est > 0:
            return est
    c0, t0 = points[-1]
    return t0 * (c / c0) ** 2


def _plot(ax: Any, s: Section) -> None:
    rows = s.data["rows"]
    xs = [r["context"] for r in rows]
    ax.plot(xs, [r["step_s"] * 1e3 for r in rows], "o-", label="kvshare decode step (sparse)")
    ax.plot(xs, [r["dense_engine_est_s"] * 1e3 for r in rows], "s--", label="dense-attention engine (estimate)")
    ax.plot(xs, [r["dense_attention_s"] * 1e3 for r in rows], "^:", label="dense attention alone")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("ms per decode step")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
