"""The table of `kvshare bench real`: both engines side by side per thread count, their ratios and
issue 37's targets, built from plain measurement dicts (no model needed, so it is unit-tested alone).

Per thread count `t`, `runs[t]` holds one dict per alternating round and engine; `summarise` takes
each measure's best over the rounds (highest tok/s, lowest step time and highest copy bandwidth,
each on its own: the machine is shared, and the best round is the one least disturbed), and the
median next to it for the JSON. The bandwidth share is kvshare's weight bytes per batch-1 decode
step over its best median step time, over the best copy read bandwidth measured at `t` threads; llama.cpp's column uses the
same bytes over its own step (its GGUF holds ~2% more: Q8_0 carries a scale per 32 values where
FP8 has one per 128 x 128 block), and the read-only bandwidth of a sum is shown beside the copy's.

Targets (issue 37): decode batch 1 >= 1.5x llama.cpp at 1 and 2 threads, batch 4 >= 1.3x and
prefill of 512 tokens >= 2x at every thread count, weight bytes per decode token over copy
bandwidth >= 0.7 at every thread count.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from kvshare.bench.report import Target

TARGET_DECODE_B1 = 1.5
TARGET_DECODE_B1_THREADS = (1, 2)
TARGET_DECODE_B4 = 1.3
TARGET_PREFILL = 2.0
TARGET_BANDWIDTH = 0.7
#: measures an engine reports per round; tok/s: higher is better, step seconds: lower is better
SPEEDS = ("decode_b1_tok_s", "decode_b4_tok_s", "prefill_tok_s")
STEPS = ("decode_b1_step_s", "decode_b4_step_s")
COLUMNS = ["threads", "measure", "kvshare", "llama.cpp", "kvshare / llama.cpp", "target"]


def summarise(rounds: list[dict[str, float]]) -> dict[str, Any]:
    """Best and median of each measure over `rounds` (module doc); {} for no rounds."""
    if not rounds:
        return {}
    out: dict[str, Any] = {"rounds": len(rounds)}
    for key in SPEEDS + STEPS + ("copy_read_gbps", "sum_read_gbps"):
        vals = [r[key] for r in rounds if key in r and not math.isnan(r[key])]
        if not vals:
            continue
        out[key] = min(vals) if key in STEPS else max(vals)
        out[f"{key}_median"] = statistics.median(vals)
    loads = [r["loadavg"] for r in rounds if "loadavg" in r]
    if loads:
        out["loadavg_max"] = max(loads)
    return out


def bandwidth_share(weight_bytes: int, step_s: float, copy_read_gbps: float) -> float:
    """Weight bytes per decode step / step time, as a fraction of the copy read bandwidth."""
    if not step_s > 0 or not copy_read_gbps > 0:
        return float("nan")
    return weight_bytes / step_s / 1e9 / copy_read_gbps


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b and not math.isnan(a) and not math.isnan(b) else None


def _speed_target(measure: str, threads: int) -> float | None:
    if measure == "decode_b1_tok_s":
        return TARGET_DECODE_B1 if threads in TARGET_DECODE_B1_THREADS else None
    return {"decode_b4_tok_s": TARGET_DECODE_B4, "prefill_tok_s": TARGET_PREFILL}.get(measure)


_LABELS = {"decode_b1_tok_s": "decode batch 1, tok/s", "decode_b1_step_s": "decode batch 1, median step ms",
           "decode_b4_tok_s": "decode batch 4, tok/s", "decode_b4_step_s": "decode batch 4, median step ms",
           "prefill_tok_s": "prefill {n} tokens, tok/s"}


def speed_rows(threads: int, kv: dict[str, Any], lc: dict[str, Any] | None, weight_bytes: int,
               prefill_len: int) -> tuple[list[list[Any]], list[Target]]:
    """Rows and targets of one thread count from `summarise`d kvshare (`kv`, with ``copy_read_gbps``)
    and llama.cpp (`lc`, None when it did not run) results."""
    rows: list[list[Any]] = []
    targets: list[Target] = []
    for key in ("decode_b1_tok_s", "decode_b1_step_s", "decode_b4_tok_s", "decode_b4_step_s", "prefill_tok_s"):
        scale = 1e3 if key in STEPS else 1.0
        a = kv.get(key)
        b = lc.get(key) if lc else None
        ratio = _ratio(a, b)
        goal = _speed_target(key, threads)
        rows.append([threads, _LABELS[key].format(n=prefill_len), None if a is None else a * scale,
                     None if b is None else b * scale, ratio, f">= {goal}x" if goal else ""])
        if goal is not None and ratio is not None:
            targets.append(Target(f"{_LABELS[key].format(n=prefill_len).split(',')[0]} at {threads} thread(s), "
                                  "kvshare / llama.cpp", ratio, goal, ">="))
    copy = kv.get("copy_read_gbps", 0.0)
    shares = [bandwidth_share(weight_bytes, d.get("decode_b1_step_s", float("nan")), copy) if d else None
              for d in (kv, lc)]
    gbps = [weight_bytes / d["decode_b1_step_s"] / 1e9 if d and d.get("decode_b1_step_s") else None for d in (kv, lc)]
    rows.append([threads, "weight GB/s read by a batch-1 decode step", *gbps, None, ""])
    rows.append([threads, "copy read bandwidth GB/s (half a copy)", kv.get("copy_read_gbps"), None, None, ""])
    rows.append([threads, "read-only bandwidth GB/s (a sum)", kv.get("sum_read_gbps"), None, None, ""])
    rows.append([threads, "weight bytes per decode token / copy read bandwidth", *shares, None,
                 f">= {TARGET_BANDWIDTH} (kvshare)"])
    share = shares[0]
    rows.append([threads, "1-minute load average, highest after a round", kv.get("loadavg_max"),
                 lc.get("loadavg_max") if lc else None, None, ""])
    if share is not None and not math.isnan(share):
        targets.append(Target(f"weight bytes per decode token / copy read bandwidth at {threads} thread(s)",
                              share, TARGET_BANDWIDTH, ">="))
    return rows, targets


TARGET_LOAD_FACTOR, TARGET_LOAD_FIXED = 1.2, 0.6e9  # issue 37: peak growth <= 1.2 x file + 0.6 GB


def load_rows(kv: dict[str, Any] | None, lc: dict[str, Any] | None) -> tuple[list[list[Any]], list[Target]]:
    """Load rows (and kvshare's peak-memory target) from `load_memory.measure_load`'s result (`kv`)
    and the llama.cpp load measurement (`lc`, the same keys); either may be None."""
    def get(d: dict[str, Any] | None, key: str, scale: float = 1.0) -> float | None:
        return d[key] / scale if d and d.get(key) is not None else None

    rows = []
    for label, key, scale in (("file GB", "checkpoint_bytes", 1e9), ("load s", "seconds", 1.0),
                              ("load MB/s", "mb_per_s", 1.0), ("peak RSS growth while loading, GB", "peak_growth_bytes", 1e9),
                              ("peak RSS growth / file", "peak_growth_over_file", 1.0),
                              ("RSS growth after load, GB", "after_growth_bytes", 1e9),
                              ("peak RSS growth incl. an 8-token generation, GB", "generate_peak_growth_bytes", 1e9)):
        a, b = get(kv, key, scale), get(lc, key, scale)
        rows.append(["-", label, a, b, _ratio(a, b), ""])
    targets = []
    if kv:
        bound = TARGET_LOAD_FACTOR * kv["checkpoint_bytes"] + TARGET_LOAD_FIXED
        rows[3][5] = f"<= {TARGET_LOAD_FACTOR} x file + {TARGET_LOAD_FIXED / 1e9} GB (kvshare)"
        targets.append(Target("kvshare peak RSS growth while loading, GB", kv["peak_growth_bytes"] / 1e9, bound / 1e9,
                              "<=", f"{TARGET_LOAD_FACTOR} x the file + {TARGET_LOAD_FIXED / 1e9} GB"))
    return rows, targets
