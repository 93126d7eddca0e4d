"""Per-rank memory of a tensor-parallel deployment, for `kvshare plan --tensor-parallel-size N`.

- Weights: every released backbone tensor counted with `ShardPlan` (what rank r holds), at
  `bytes_per_param` (kvshare keeps weights decoded in the model dtype).
- Cache: every cache is replicated (B.4), so each rank holds the whole layout: the per-token,
  per-block and per-sequence figures of `CacheLayout` apply to every rank unchanged.
- Engram (V4.1, engram_dspark.md §1.1, §1.11): each layer's table has 24 hash columns (n-gram sizes
  2..4 x 8 heads); column c of the i-th Engram layer has ``p`` rows, p the (24 i + c)-th prime above
  ``engram_vocab_size - 1``. Ranks own whole columns (rank r: columns [r 24/N, (r+1) 24/N)) when N
  divides 24, else an even row split (ceil(rows / N)). Rows are stored FP8 with one ue8m0 scale per
  32 values: ``head_dim + head_dim / 32`` bytes (264 B for head_dim 256). Config fields missing from
  a config take the released V4.1-Flash values.
"""

from __future__ import annotations

import json
import math
from typing import Any

from kvshare.config import ModelConfig
from kvshare.model.hf_naming import released_shapes
from kvshare.parallel.shard import ShardPlan, check_divisible

ENGRAM_DEFAULTS = {"engram_vocab_size": 16_000_000, "engram_n_heads": 8, "engram_max_ngram_size": 4,
                   "engram_head_dim": 256}


def primes_above(start: int, count: int) -> list[int]:
    """The `count` smallest primes greater than `start` (segmented sieve)."""
    out: list[int] = []
    lo, span = start + 1, 4096
    while len(out) < count:
        hi = lo + span
        small = _small_primes(math.isqrt(hi) + 1)
        mark = bytearray([1]) * span
        for p in small:
            first = max(p * p, (lo + p - 1) // p * p)
            mark[first - lo:span:p] = bytes(len(range(first - lo, span, p)))
        out.extend(lo + i for i in range(span) if mark[i] and lo + i > 1)
        lo = hi
    return out[:count]


def _small_primes(n: int) -> list[int]:
    sieve = bytearray([1]) * (n + 1)
    sieve[:2] = b"\x00\x00"
    for i in range(2, math.isqrt(n) + 1):
        if sieve[i]:
            sieve[i * i::i] = bytes(len(range(i * i, n + 1, i)))
    return [i for i in range(n + 1) if sieve[i]]


def engram_fields(raw: dict[str, Any]) -> dict[str, int]:
    """Engram sizes from a raw config dict (HF ``text_config`` or flat), defaults where missing."""
    src = raw.get("text_config", raw)
    return {k: int(src.get(k, v)) for k, v in ENGRAM_DEFAULTS.items()}


def engram_rows_per_rank(cfg: ModelConfig, raw: dict[str, Any], size: int) -> tuple[list[int], int]:
    """(table rows each rank holds over all Engram layers, bytes per row)."""
    f = engram_fields(raw)
    cols = (f["engram_max_ngram_size"] - 1) * f["engram_n_heads"]
    n_layers = len(cfg.engram_layer_ids)
    primes = primes_above(f["engram_vocab_size"] - 1, cols * n_layers)
    per_rank = [0] * size
    for i in range(n_layers):
        layer = primes[i * cols:(i + 1) * cols]
        step = -(-sum(layer) // size)  # even row split when ranks cannot own whole columns
        for r in range(size):
            if cols % size == 0:
                per_rank[r] += sum(layer[r * cols // size:(r + 1) * cols // size])
            else:
                per_rank[r] += min(step, max(0, sum(layer) - r * step))
    d = f["engram_head_dim"]
    return per_rank, d + d // 32


def rank_plan(cfg: ModelConfig, size: int, bytes_per_param: int, raw: dict[str, Any] | None = None
              ) -> dict[str, Any]:
    """Per-rank weights (params, bytes) and Engram rows / bytes; ConfigError if `size` does not divide."""
    check_divisible(cfg, size)
    shapes = released_shapes(cfg)
    total = sum(math.prod(s) for s in shapes.values())
    ranks = []
    rows, row_bytes = engram_rows_per_rank(cfg, raw or {}, size) if cfg.engram_layer_ids else ([0] * size, 0)
    for r in range(size):
        plan = ShardPlan(cfg, r, size)
        params = 0
        for name, shape in shapes.items():
            p = plan.place(name, tuple(shape))
            if p is not None:
                params += math.prod(shape) if p[1] is None else math.prod(shape) // shape[p[1]] * p[3]
        ranks.append({"rank": r, "weight_params": params, "weight_bytes": params * bytes_per_param,
                      "engram_rows": rows[r], "engram_bytes": rows[r] * row_bytes})
    return {"size": size, "bytes_per_param": bytes_per_param, "total_weight_params": total,
            "engram_row_bytes": row_bytes, "ranks": ranks}


def raw_config(source: Any) -> dict[str, Any]:
    """The config's raw dict (for fields ModelConfig does not keep): `source` itself when it is a dict,
    else the file it names; {} when there is none."""
    from kvshare.errors import ConfigError
    from kvshare.shipped import resolve_config_path

    if isinstance(source, dict):
        return source
    try:
        return json.loads(resolve_config_path(str(source)).read_text())
    except (OSError, ValueError, ConfigError):
        return {}
