"""What each tensor-parallel rank holds (phase2_design.md B.4), and the transform that shards a model.

Sharded (rank r of n holds the r-th contiguous 1/n):
- ``attn.wq_b`` output rows and ``attn.attn_sink`` by query head; ``attn.wo_a`` output rows by
  output group (heads of a group are contiguous, so a rank's heads are exactly its groups' heads);
  ``attn.wo_b`` input columns by group, row-parallel (fp32 all-reduce of its output);
- routed experts ``ffn.experts.{E}`` by expert id (expert parallelism inside the group; rank r runs
  experts ``[r E/n, (r+1) E/n)`` on every token it routes there, fp32 all-reduce of the routed sum;
  the shared expert is replicated and added after the reduce);
- ``embed`` and ``head`` by vocabulary rows: rank r holds ``[r v, min((r+1) v, vocab))`` with
  ``v = ceil(vocab / n)``, so any vocabulary splits (the last shard may be shorter; the head pads its
  logits to ``v`` columns for the all-gather and drops the padding after it, as vLLM pads its vocab).
Everything else is replicated: ``wq_a``, ``wkv``, norms, mHC, compressors, the indexer (so top-k
equals TP=1's), the router, every cache, and Engram's `wkv` and gates. Engram tables are split by
hash columns (`parallel/engram_shard.py`: each rank keeps whole columns' rows, lookups all-gathered).

`apply_tp(model, group)` shards a built (loaded) model in place: module shapes change, parameter
names stay the released checkpoint names except that a rank's experts are numbered from 0.
`restructure` alone changes the shapes without data (for a meta-device model that the sliced
loader then fills).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvshare.config import ModelConfig
from kvshare.errors import ConfigError
from kvshare.model.quantize import fit_block
from kvshare.parallel.engram_shard import check_engram_divisible, shard_engram
from kvshare.parallel.layers import ParallelHead, VocabParallelEmbedding, make_row_parallel, narrowed

_EXPERT = re.compile(r"^(layers\.\d+\.ffn\.experts\.)(\d+)(\..+)$")
_ROW_SPLIT = {"attn.wq_b.weight": 0, "attn.attn_sink": 0, "attn.wo_a.weight": 0, "attn.wo_b.weight": 1}
_VOCAB = ("embed.weight", "head.weight")


def check_divisible(cfg: ModelConfig, size: int, act_quant: bool = False) -> None:
    """ConfigError (naming the field) unless `cfg` splits evenly over `size` ranks.

    With FP8 activation rounding on, each rank's ``wo_b`` input must hold whole quantisation
    blocks, or the blocks (and their scales) would differ from TP=1's.
    """
    if size < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, got {size}", field="tensor_parallel_size")
    for field, value in (("num_attention_heads", cfg.num_attention_heads), ("o_groups", cfg.o_groups),
                         ("n_routed_experts", cfg.n_routed_experts)):
        if value % size:
            raise ConfigError(f"{value} is not divisible by tensor_parallel_size {size}", field=field,
                              fix="choose a tensor-parallel size that divides it")
    check_engram_divisible(cfg, size)
    width = cfg.o_groups * cfg.o_lora_rank
    block = fit_block(width, cfg.act_quant_block)
    if act_quant and (width // size) % block:
        raise ConfigError(f"each rank's wo_b input ({width // size} = o_groups {cfg.o_groups} x o_lora_rank "
                          f"{cfg.o_lora_rank} / {size}) is not a whole number of FP8 activation blocks of "
                          f"{block}", field="o_lora_rank",
                          fix="use a smaller tensor-parallel size or turn activation quantisation off")


@dataclass(frozen=True)
class ShardPlan:
    """Which slice of each released-naming tensor rank `rank` of `size` holds."""

    cfg: ModelConfig
    rank: int
    size: int

    @property
    def vocab_shard(self) -> int:
        """Rows of every rank's (padded) vocabulary shard: ceil(vocab / size)."""
        return -(-self.cfg.vocab_size // self.size)

    @property
    def vocab_rows(self) -> tuple[int, int]:
        """(start, length) of the vocabulary rows this rank holds (length < vocab_shard on the last
        rank when the vocabulary does not divide; 0 when there are more ranks than rows left)."""
        v = self.vocab_shard
        start = min(self.rank * v, self.cfg.vocab_size)
        return start, min(v, self.cfg.vocab_size - start)

    @property
    def experts(self) -> tuple[int, int]:
        """[lo, hi) of the routed expert ids this rank holds."""
        n = self.cfg.n_routed_experts // self.size
        return self.rank * n, (self.rank + 1) * n

    def place(self, name: str, shape: tuple[int, ...]) -> tuple[str, int | None, int, int] | None:
        """(local name, dim, start, length) of this rank's part of tensor `name` with global `shape`;
        dim None = the whole tensor (replicated); None = this rank holds none of it."""
        m = _EXPERT.match(name)
        if m:
            lo, hi = self.experts
            e = int(m.group(2))
            return (f"{m.group(1)}{e - lo}{m.group(3)}", None, 0, 0) if lo <= e < hi else None
        if name in _VOCAB:
            return (name, 0, *self.vocab_rows)
        dim = next((d for k, d in _ROW_SPLIT.items()
                                             if name.startswith("layers.") and name.endswith(k)), None)
        if dim is None:
            return name, None, 0, 0
        n = shape[dim] // self.size
        return name, dim, self.rank * n, n

    def shard_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's state dict (local names, narrowed copies) from a full released-naming one."""
        out: dict[str, torch.Tensor] = {}
        for name, t in state.items():
            p = self.place(name, tuple(t.shape))
            if p is not None:
                local, dim, start, length = p
                out[local] = t if dim is None else t.narrow(dim, start, length).clone()
        return out


def restructure(model: nn.Module, plan: ShardPlan, group: Any) -> nn.Module:
    """Give `model` this rank's module shapes and register the reductions (parameter data undefined
    where shapes changed). Works on any device, meta included."""
    cfg, size = plan.cfg, plan.size
    lo, hi = plan.experts
    for block in model.layers:
        attn, ffn = block.attn, block.ffn
        for name, dim in (("wq_b", 0), ("wo_a", 0), ("wo_b", 1)):
            lin = getattr(attn, name)
            lin.weight = _local(lin.weight, dim, plan)
            lin.in_features, lin.out_features = lin.weight.shape[1], lin.weight.shape[0]
        attn.attn_sink = _local(attn.attn_sink, 0, plan)
        attn.n_heads = cfg.num_attention_heads // size
        attn.n_groups = cfg.o_groups // size
        make_row_parallel(attn.wo_b, group)
        ffn.experts = nn.ModuleList(list(ffn.experts)[lo:hi])
        ffn.expert_offset = lo
        ffn.reduce = group.all_reduce
    start, length = plan.vocab_rows
    model.embed = VocabParallelEmbedding(narrowed(model.embed.weight, 0, start, length).data, start, group)
    model.head = ParallelHead(narrowed(model.head.weight, 0, start, length).data, group,
                              plan.vocab_shard, cfg.vocab_size)
    shard_engram(model, plan.rank, size, group)
    model.tp_plan = plan
    return model


def _local(param: torch.Tensor, dim: int, plan: ShardPlan) -> nn.Parameter:
    n = param.shape[dim] // plan.size
    return narrowed(param, dim, plan.rank * n, n)


def apply_tp(model: nn.Module, group: Any) -> nn.Module:
    """Shard a built model in place for ``group.rank`` of ``group.size`` (see module doc); returns it."""
    act = bool(getattr(getattr(model, "quant", None), "act", False))
    check_divisible(model.cfg, group.size, act_quant=act)
    plan = ShardPlan(model.cfg, group.rank, group.size)
    if group.size == 1:
        return model
    full = model.state_dict()
    restructure(model, plan, group)
    local = plan.shard_state(full)
    del full
    own = model.state_dict()
    with torch.no_grad():
        for name, t in local.items():
            own[name].copy_(t)
    return model
