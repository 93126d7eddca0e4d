"""Per-rank memory of a tensor-parallel deployment, for `kvshare plan --tensor-parallel-size N`.

- Weights: every released backbone tensor counted with `ShardPlan` (what rank r holds), at
  `bytes_per_param` (kvshare keeps weights decoded in the model dtype).
- Cache: every cache is replicated (B.4), so each rank holds the whole layout: the per-token,
  per-block and per-sequence figures of `CacheLayout` apply to every rank unchanged.
- Engram (V4.1): the host-resident tables (FP8 rows + row scales) are split by hash columns
  (`engram_shard`): rank r holds its columns' rows, `rank_table_bytes`; the ranks' figures sum to
  `config.engram.engram_bytes`' ``tables``.
"""

from __future__ import annotations

import math
from typing import Any

from kvshare.config import ModelConfig
from kvshare.weights.hf_naming import released_shapes
from kvshare.parallel.engram_shard import rank_table_bytes
from kvshare.parallel.shard import ShardPlan, check_divisible


def rank_plan(cfg: ModelConfig, size: int, bytes_per_param: int) -> dict[str, Any]:
    """Per-rank weights (params, bytes) and Engram table bytes; ConfigError if `size` does not divide."""
    check_divisible(cfg, size)
    shapes = released_shapes(cfg)
    ranks = []
    for r in range(size):
        plan = ShardPlan(cfg, r, size)
        params = 0
        for name, shape in shapes.items():
            p = plan.place(name, tuple(shape))
            if p is not None:
                params += math.prod(shape) if p[1] is None else math.prod(shape) // shape[p[1]] * p[3]
        ranks.append({"rank": r, "weight_params": params, "weight_bytes": params * bytes_per_param,
                      "engram_table_bytes": rank_table_bytes(cfg, r, size)})
    return {"size": size, "bytes_per_param": bytes_per_param,
            "total_weight_params": sum(math.prod(s) for s in shapes.values()), "ranks": ranks}
