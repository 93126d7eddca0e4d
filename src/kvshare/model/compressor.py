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

Checkpoint names: ``wkv.weight``, ``wgate.weight`` (ratio > 1), ``norm.weight``, ``ape`` (V4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvshare.model.linear import plain_linear
from kvshare.model.norm import RMSNorm
from kvshare.ops import invariant
from kvshare.precision import wide

if TYPE_CHECKING:
    from kvshare.model.context import StepContext


@dataclass
class Emitted:
    """Entries completed in this step. Invariant: all tensors share the leading size E (may be 0)."""

    rows: torch.Tensor  # [E] token rows whose token completed the group
    seq: torch.Tensor  # [E] sequence index within the batch
    j: torch.Tensor  # [E] compressed entry index
    latent: torch.Tensor  # [E, d] pre-RoPE, normalised

    def positions(self, ratio: int) -> torch.Tensor:
        """RoPE position of each entry: its group's first token."""
        return self.j * ratio


class Compressor(nn.Module):
    """One compressor of width `dim` (head_dim for KV, index_head_dim for V4 index keys)."""

    def __init__(self, hidden: int, dim: int, ratio: int, eps: float, *, overlap: bool, ape: bool,
                 name: str = "compressor") -> None:
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
        if ape:
            self.ape = nn.Parameter(torch.zeros(ratio, self.coff * dim))

    @property
    def depth(self) -> int:
        """Tokens of history one group needs (coff * ratio)."""
        return self.coff * self.ratio

    def forward(self, x: torch.Tensor, ctx: "StepContext", layer: int) -> Emitted:
        pos = ctx.positions
        if self.ratio == 1:
            latent = self.norm(self.wkv(x))
            rows = torch.arange(x.shape[0], device=x.device)
            return Emitted(rows, ctx.seq_index, pos, latent)

        xf = wide(x)
        a = invariant.linear(xf, wide(self.wkv.weight))
        z = invariant.linear(xf, wide(self.wgate.weight))
        if hasattr(self, "ape"):
            z = z + wide(self.ape)[pos % self.ratio]
        rows = torch.nonzero((pos + 1) % self.ratio == 0).flatten()
        hist, valid = ctx.cache.history(self.name, layer, torch.cat([a, z], dim=-1), self.depth, ctx.batch, rows)
        w = self.coff * self.dim
        kv, score = hist[..., :w], hist[..., w:]
        if self.overlap:
            r, d = self.ratio, self.dim
            kv = torch.cat([kv[:, :r, :d], kv[:, r:, d:]], dim=1)
            score = torch.cat([score[:, :r, :d], score[:, r:, d:]], dim=1)
        if not bool(valid.all()):  # positions before 0 (a prompt's first groups) take no weight
            score = score.masked_fill(~valid.unsqueeze(-1), float("-inf"))
            kv = kv.masked_fill(~valid.unsqueeze(-1), 0.0)
        pooled = (torch.softmax(score, dim=1) * kv).sum(dim=1)
        latent = self.norm(pooled.to(x.dtype))
        return Emitted(rows, ctx.seq_index[rows], (pos[rows] + 1) // self.ratio - 1, latent)
