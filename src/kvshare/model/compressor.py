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

from kvshare import kernels
from kvshare.kernels import decode as native
from kvshare.kernels.pack_memo import per_generation
from kvshare.model.linear import plain_linear
from kvshare.model.norm import RMSNorm
from kvshare.ops import invariant
from kvshare.precision import version_of, wide
from kvshare.step_addresses import Groups

if TYPE_CHECKING:
    from kvshare.model.context import StepContext


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
        self._fused: tuple[tuple, "kernels.Packed"] | None = None  # see `_fused_pack`
        self.norm = RMSNorm(dim, eps)
        self.has_ape = ape
        if ape:
            self.ape = nn.Parameter(torch.zeros(ratio, self.coff * dim))

    def _held(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(wkv weight, wgate weight, APE or None) kept on the module per
        `kernels.moe.generation` (a replaced parameter or submodule anywhere starts a new one): the
        parameters without the module attribute lookups of every decode step."""
        return per_generation(self, "_held_params", lambda: (self.wkv.weight, self.wgate.weight,
                                                             self.ape if self.has_ape else None))

    def _fused_pack(self) -> "kernels.Packed | None":
        """The kernels' pack of ``cat([wide(wkv), wide(wgate)])`` (rows [a | z]), made once per version
        of the two weights; None where the kernels do not serve them (no native library, not CPU)."""
        wkv, wgate, _ = self._held()
        key = (wkv.data_ptr(), version_of(wkv), wgate.data_ptr(), version_of(wgate), wkv.dtype, wgate.dtype)
        fused = self._fused
        if fused is not None and fused[0] == key:  # (a pack exists only where the checks below held)
            return fused[1]
        if not kernels.available() or wkv.device.type != "cpu" or wkv.dtype == torch.float64:
            return None
        with torch.no_grad():
            self._fused = (key, kernels.pack(torch.cat([wide(wkv), wide(wgate)]).detach()))
        return self._fused[1]

    @property
    def depth(self) -> int:
        """Tokens of history one group needs (coff * ratio)."""
        return self.coff * self.ratio

    def forward(self, x: torch.Tensor, ctx: "StepContext", layer: int) -> Emitted:
        addr = ctx.addr
        groups = addr.groups(self.ratio)
        if self.ratio == 1:
            return Emitted(groups, self.norm(self.wkv(x)))

        packed = self._fused_pack() if invariant.is_on() else None
        ape = self._held()[2]
        ape = None if ape is None else wide(ape)
        if packed is not None and packed.fmt == "fp32" and native.serves(x):
            # [a | z] and the APE in one call: each output is the fixed-order kernel's sum over K
            # alone (the same bits as the two products), the APE one rounded add
            az = native.project_wide(x, packed, ape, ctx.positions, self.coff * self.dim)
        elif packed is not None and wide(x).dtype == packed.act_dtype:
            az = kernels.linear_checked(wide(x), packed)
            if ape is not None:
                az[:, self.coff * self.dim:] += ape[addr.phase(self.ratio)]
        else:
            xf = wide(x)
            a = invariant.linear(xf, wide(self.wkv.weight))
            z = invariant.linear(xf, wide(self.wgate.weight))
            if ape is not None:
                z = z + ape[addr.phase(self.ratio)]
            az = torch.cat([a, z], dim=-1)
        if groups.count == 0:  # no group completes (most decode steps): only the ring keeps az
            ctx.cache.remember(self.name, layer, az, self.depth, ctx.batch)
            return Emitted(groups, x.new_empty(0, self.dim))
        hist, valid = ctx.cache.history(self.name, layer, az, self.depth, ctx.batch, groups.rows)
        # the same bits in one call for dims that are a multiple of 64 (the released 128 / 512 and
        # 64 / 128): for narrower or odd rows torch's softmax / sum take other loops (scalar tails,
        # another reduction order; measured there: not even row-invariant), so they keep the torch code
        if invariant.is_on() and self.dim % 64 == 0 and hist.dtype == torch.float32 and native.serves(hist, x):
            mask = valid if groups.min_pos < self.depth - 1 else None
            return Emitted(groups, self.norm(native.compress_pool(hist, mask, self.dim, self.overlap, x.dtype)))
        w = self.coff * self.dim
        kv, score = hist[..., :w], hist[..., w:]
        if self.overlap:
            r, d = self.ratio, self.dim
            kv = torch.cat([kv[:, :r, :d], kv[:, r:, d:]], dim=1)
            score = torch.cat([score[:, :r, :d], score[:, r:, d:]], dim=1)
        if groups.min_pos < self.depth - 1:  # positions before 0 (a prompt's first groups) take no weight
            score = score.masked_fill(~valid.unsqueeze(-1), float("-inf"))
            kv = kv.masked_fill(~valid.unsqueeze(-1), 0.0)
        pooled = (torch.softmax(score, dim=1) * kv).sum(dim=1)
        return Emitted(groups, self.norm(pooled.to(x.dtype)))
