"""cache_plan: the one answer to "what cache does this model get under these engine arguments".

`cache_plan(cfg, topo, args, ...)` is used by the engine (to build its pool), `kvshare plan` (to
print it) and the benchmarks, so the three cannot disagree. It resolves:

* the layout (`CacheLayout` on the model's own `Topology`, sharing from ``share_kv_cache``):
  ``block_size`` None = lcm(64, every compress ratio in use) (64 for V4.1, 128 for V4);
  ``kv_format`` "auto" = the architecture's packed fp4 / fp8 formats when quantising, else plain
  rows matching the model dtype (fp32, fp64 or bf16) for kv, index keys and window; a tuple gives
  (kv, index K, window) directly (None entries: the packed format); one slack row per draft in
  every window and compressor ring when speculating (spec engram_dspark.md §2.8);
* the pool: ``num_blocks``, else what ``gpu_memory_bytes`` holds after every slot's rings, else
  enough blocks for ``max_num_seqs`` full-length sequences (capped at 1 GiB); null block included;
* ``max_model_len``: None = min(model positions, what the pool holds); SetupError when the
  requested length does not fit;
* the prefix checkpoint budget (`checkpoint_budget`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kvshare.cache.checkpoint import checkpoint_bytes
from kvshare.cache.layout import CacheLayout
from kvshare.config import ModelConfig
from kvshare.engine.args import EngineArgs
from kvshare.engine.spec_config import SpeculativeConfig
from kvshare.errors import SetupError
from kvshare.topology import Topology

DEFAULT_POOL_CAP_BYTES = 1 << 30
DEFAULT_CHECKPOINT_CAP_BYTES = 256 << 20


@dataclass(frozen=True)
class CachePlan:
    """The resolved cache of one engine. Invariant: ``max_model_len <= (num_blocks - 1) * block_size``."""

    layout: CacheLayout
    num_blocks: int  # null block included
    num_slots: int  # request slots, each with its own rings
    max_model_len: int
    checkpoint_budget: int  # bytes of prefix-cache checkpoints

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def block_bytes(self) -> int:
        """Bytes of the block pool (every block, the null block included)."""
        return self.num_blocks * self.layout.bytes_per_block

    @property
    def state_bytes(self) -> int:
        """Bytes of every slot's rings (window and compressor states)."""
        return self.num_slots * self.layout.state_bytes_per_seq

    @property
    def total_bytes(self) -> int:
        return self.block_bytes + self.state_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"block_size": self.block_size, "num_blocks": self.num_blocks, "num_slots": self.num_slots,
                "max_model_len": self.max_model_len, "bytes_per_block": self.layout.bytes_per_block,
                "block_bytes": self.block_bytes, "state_bytes": self.state_bytes, "total_bytes": self.total_bytes,
                "checkpoint_budget": self.checkpoint_budget}


def cache_plan(cfg: ModelConfig, topo: Topology, args: EngineArgs, cache_quant: bool = True,
               index_quant: bool = True, dtype: torch.dtype = torch.bfloat16) -> CachePlan:
    """The cache an engine over a model with `cfg` / `topo` gets under `args` (module doc).

    `cache_quant` / `index_quant`: whether the model rounds kv + window rows / index keys to the
    packed formats; `dtype`: the model dtype (plain rows match it)."""
    layout = build_layout(cfg, topo, args, cache_quant, index_quant, dtype)
    model_len = min(args.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    num_blocks = pool_blocks(layout, args, model_len)
    capacity = (num_blocks - 1) * layout.block_size
    if args.max_model_len is not None and args.max_model_len > capacity:
        raise SetupError(f"max_model_len {args.max_model_len} exceeds what the pool holds ({num_blocks - 1} "
                         f"blocks x {layout.block_size} = {capacity} tokens); raise --memory / "
                         "--num-blocks or lower --max-model-len")
    return CachePlan(layout, num_blocks, max(1, args.max_num_seqs), min(model_len, capacity),
                     checkpoint_budget(layout, args))


def default_block_size(topo: Topology) -> int:
    bs = 64
    for r in topo.ratios_in_use:
        bs = bs * r // math.gcd(bs, r)
    return bs


def build_layout(cfg: ModelConfig, topo: Topology, args: EngineArgs, cache_quant: bool, index_quant: bool,
                 dtype: torch.dtype) -> CacheLayout:
    """The cache layout of the pool: topology, sharing, block size and row formats.

    A quantised group (kv + window rows, or index keys) gets the architecture's packed format, a
    plain group fp32 / bf16 rows like the model, so storing what the model computes is lossless.
    """
    bs = args.block_size or default_block_size(topo)
    # Plain rows hold what the model computes, losslessly: a float64 model keeps float64 rows.
    plain = {torch.float32: "fp32", torch.float64: "fp64"}.get(dtype, "bf16")
    if isinstance(args.kv_format, (tuple, list)):
        kv, ik, win = args.kv_format
    else:
        kv = win = None if cache_quant else plain
        ik = None if index_quant else plain
        if args.kv_format not in (None, "auto"):
            kv = args.kv_format
    slack = speculative_slack(cfg, args)
    wide = 8 if dtype == torch.float64 else 4  # compressor states "fp32 or wider", like the model's steps
    return CacheLayout(topo, bs, kv_format=kv, index_format=ik, window_format=win, state_dtype_bytes=wide,
                       window_slack=slack, state_slack=slack, share_cache=args.share_kv_cache)


def speculative_slack(cfg: ModelConfig, args: EngineArgs) -> int:
    """Ring rows a verify step needs on top of each window / compressor depth: one per draft token
    (spec engram_dspark.md §2.8); 0 without speculation."""
    spec = SpeculativeConfig.parse(args.speculative_config)
    return 0 if spec is None else spec.num_tokens(cfg)


def pool_blocks(layout: CacheLayout, args: EngineArgs, model_len: int) -> int:
    """Number of blocks (null block included) the pool allocates."""
    if args.num_blocks is not None:
        n = args.num_blocks
    elif args.gpu_memory_bytes is not None:
        n = layout.blocks_for_memory(args.gpu_memory_bytes, args.max_num_seqs)
    else:
        want = args.max_num_seqs * -(-model_len // layout.block_size) + 1
        cap = max(2, DEFAULT_POOL_CAP_BYTES // max(1, layout.bytes_per_block))
        n = min(want, cap)
    if n < 2:
        raise SetupError(f"the KV-cache pool gets {n} blocks of {layout.bytes_per_block:,} B; it needs at least 2 "
                         "(raise --memory or --num-blocks, or lower --max-num-seqs; in the Python API: "
                         "gpu_memory_bytes, num_blocks, max_num_seqs)")
    return n


def checkpoint_budget(layout: CacheLayout, args: EngineArgs) -> int:
    """Bytes the prefix cache's boundary checkpoints may hold: ``prefix_checkpoint_bytes``, else four
    checkpoints per request slot, capped at 256 MiB but never below one checkpoint."""
    if args.prefix_checkpoint_bytes is not None:
        if args.prefix_checkpoint_bytes < 0:
            raise ValueError(f"prefix_checkpoint_bytes must be >= 0, got {args.prefix_checkpoint_bytes}")
        return args.prefix_checkpoint_bytes
    one = checkpoint_bytes(layout)
    return max(one, min(DEFAULT_CHECKPOINT_CAP_BYTES, 4 * max(1, args.max_num_seqs) * one))
