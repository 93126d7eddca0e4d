"""KV compressors (spec/model.md §4.5): turn groups of `ratio` tokens into one pre-RoPE latent.

* V4.1 ratio 1: ``latent_t = norm(wkv(x_t))``; every token emits entry j = t; no state.
* V4.1 ratio 2: fp32 projections ``a = wkv(x)``, ``z = wgate(x)``; group j = tokens (2j, 2j+1);
  per channel, softmax over the 2 tokens of z weights a; cast to the model dtype; norm.
* V4 ratio 128 (HCA): the same over 128 tokens, with the learned APE ``ape[p mod 128]`` added to z.
* V4 ratio 4 (CSA, overlapping): projections are 2d wide; entry j pools 8 slots per channel:
  the first half (Ca, dims [0, d)) of tokens [4(j-1), 4j) and the second half (Cb, dims [d, 2d))
  of tokens [4j, 4j+4); APE added to z; for j = 0 the Ca slots have weight 0.

A group is emitted only when its last token is processed (``(t + 1) % ratio == 0``), by that token's
row; entry j's RoPE position is its first token, ``ratio * j`` (applied by the caller, which also
derives index keys from the pre-RoPE latent first). Partial groups live in the backend's history
ring named `name` (depth ``coff * ratio``; one fp32 row per token = [a | z + ape]), so chunk
boundaries and decode steps give the same entries as a one-shot prefill.

The projection [a | z + ape] and the pooling are layers bound once per model build
(`kvshare.layers.compressor`: `CompressProject`, `CompressPool`).

Checkpoint names: ``wkv.weight``, ``wgate.weight`` (ratio > 1), ``norm.weight``, ``ape`` (V4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvshare.layers.compressor import CompressPool, CompressProject
from kvshare.layers.linear import plain_linear
from kvshare.layers.norm import RMSNorm
from kvshare.step.addresses import Groups

if TYPE_CHECKING:
    from kvshare.step.context import StepContext


@dataclass
class Emitted:
    """Entries completed in this step: the step's `Groups` of this ratio (token rows, sequence,
    entry index j, RoPE position j * ratio, host count) and their latents [E, d]."""

    groups: Groups
    latent: torch.Tensor  # [E, d] pre-RoPE, normalised

    @property
    def seq(self) -> torch.Tensor:
        return self.groups.seq

    @property
    def j(self) -> torch.Tensor:
        return self.groups.j

    @property
    def positions(self) -> torch.Tensor:
        """RoPE position of each entry: its group's first token (one tensor per step and ratio)."""
        return self.groups.positions

    @property
    def count(self) -> int:
        return self.groups.count


class Compressor(nn.Module):
    """One compressor of width `dim` (head_dim for KV, index_head_dim for V4 index keys)."""

    def __init__(self, hidden: int, dim: int, ratio: int, eps: float, *, overlap: bool, ape: bool,
                 name: str = "compressor") -> None:
        """`overlap`: entries pool two groups (the model asks ``cache.layout.overlap_factor``,
        the one place that decides which compressors overlap)."""
        super().__init__()
        self.ratio = ratio
        self.dim = dim
        self.overlap = overlap
        self.coff = 2 if overlap else 1
        self.name = name
        self.wkv = plain_linear(hidden, self.coff * dim)
        if ratio > 1:
            self.wgate = plain_linear(hidden, self.coff * dim)
        self.norm = RMSNorm(dim, eps)
        self.has_ape = ape
        if ape:
            self.ape = nn.Parameter(torch.zeros(ratio, self.coff * dim))
        if ratio > 1:  # the two bound units (kvshare.layers.compressor); they hold no parameters
            self.project = CompressProject(self)
            self.pool = CompressPool(ratio, dim, overlap)

    @property
    def depth(self) -> int:
        """Tokens of history one group needs (coff * ratio)."""
        return self.coff * self.ratio

    def forward(self, x: torch.Tensor, ctx: "StepContext", layer: int) -> Emitted:
        groups = ctx.addr.groups(self.ratio)
        if self.ratio == 1:
            return Emitted(groups, self.norm(self.wkv(x)))
        az = self.project(x, ctx)  # [T, 2 coff d] fp32: [a | z + ape]
        if groups.count == 0:  # no group completes (most decode steps): only the ring keeps az
            ctx.cache.remember(self.name, layer, az, self.depth, ctx.batch)
            return Emitted(groups, x.new_empty(0, self.dim))
        hist, valid = ctx.cache.history(self.name, layer, az, self.depth, ctx.batch, groups.rows)
        mask = valid if groups.min_pos < self.depth - 1 else None  # positions before 0 take no weight
        return Emitted(groups, self.norm(self.pool(hist, mask, x.dtype)))
