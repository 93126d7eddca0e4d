"""Sharded building blocks: column / row parallel linears, vocab-parallel embedding and head.

A column-parallel linear is a plain linear whose weight holds this rank's output rows (no
communication: its outputs are this rank's heads or groups). A row-parallel linear holds this
rank's input columns; `make_row_parallel` registers a forward hook that sums the partial outputs
over ranks (fp32 all-reduce), so parameter names stay those of the checkpoint. The vocabulary is
split in contiguous ranges of ``ceil(vocab_size / size)`` rows (the last one may be shorter): the
embedding looks up the ids it owns (zeros elsewhere) and all-reduces; the head computes its logits
columns, pads them to the common shard width, all-gathers them and drops the padding.

`group` is anything with ``rank``, ``size``, ``all_reduce`` and ``all_gather`` (a `TPGroup`, or a
test's in-process stand-in), so one shard's partial results can be checked without processes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def narrowed(param: torch.Tensor, dim: int, start: int, length: int) -> nn.Parameter:
    """A new parameter holding ``param.narrow(dim, start, length)`` (own storage, so the rest is freed)."""
    return nn.Parameter(param.detach().narrow(dim, start, length).clone(), requires_grad=param.requires_grad)


def make_row_parallel(module: nn.Module, group: Any) -> None:
    """Sum `module`'s output over ranks after each forward (its weight must hold this rank's columns)."""
    module.register_forward_hook(lambda _m, _inp, out: group.all_reduce(out))


class VocabParallelEmbedding(nn.Module):
    """Embedding rows ``[start, start + weight.shape[0])`` of the vocabulary; other ids look up zeros."""

    def __init__(self, weight: torch.Tensor, start: int, group: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start = start
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


class ParallelHead(nn.Module):
    """LM head over this rank's vocabulary rows; the logits of all ranks are gathered in vocab order.

    Every rank sends `shard` columns (its own rows' logits, zero-padded), so ranks may hold fewer
    rows than `shard`; the gathered row keeps the first `vocab` columns."""

    def __init__(self, weight: torch.Tensor, group: Any, shard: int | None = None, vocab: int | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.group = group
        self.shard = weight.shape[0] if shard is None else shard
        self.vocab = self.shard * group.size if vocab is None else vocab

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight)
        if local.shape[-1] < self.shard:
            local = F.pad(local, (0, self.shard - local.shape[-1]))
        return self.group.all_gather(local)[..., :self.vocab]
