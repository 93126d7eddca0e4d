"""Interleaved partial RoPE with optional YaRN (spec/model.md §4.2), as a bound layer.

Only the TRAILING `qk_rope_head_dim` dims of a vector rotate; adjacent pairs (2i, 2i+1) of that
tail are complex numbers multiplied by exp(i * pos * f_i). Ratio-0 layers use `rope_theta` without
YaRN; every ratio > 0 layer (Full, Reindex and Reuse alike) uses `compress_rope_theta` with YaRN
when the config has it. No YaRN magnitude scaling (mscale) is applied anywhere.

Angles are computed on the fly from the positions (no table of max_position_embeddings rows) in
fp32, or in float64 for a float64 input (`precision.wide`: exactness runs stay float64); the
rotation runs in that dtype and the result is cast back to the input dtype once. Frequencies are
kept in float64 outside the module's buffers, so ``model.to(bfloat16)`` cannot round them.
Each rotation is ``out = tail * C + swap(tail) * S`` over the whole rope tail, where swap
exchanges the two halves of every pair, ``C = (cos, cos)`` and ``S = (-sin, +sin)`` per pair:
element 2i is ``a cos + b (-sin)`` and 2i+1 is ``b cos + a sin``, the same bits as the complex
product ``(a cos - b sin, a sin + b cos)`` (negation is exact, and IEEE + is commutative). The
(C, S, -S) tables of the last few positions tensors are kept per working dtype (keyed by the
tensor's identity and version, holding a reference so its memory cannot be reused), so the q,
kv, latent and output rotations of a step build each once.

Implementations (bound once, `kvshare.layers`): `forward_torch` (the reference above) and, for a
choice with the native kernels (any mode: each product and the sum are correctly rounded, so the
kernel has the reference's bits), `forward_native` = `kernels.decode.rope` on the fp32 tables. The
native implementation runs the reference for a call it does not take (an input that is not a
contiguous tensor, positions that are not 1-D, an input autograd records: a model built outside an
engine binds the batched native choice, and a caller may train it): the same bits. It assumes the
choice's other invariants (`KernelChoice`: bf16 / fp32 CPU activations).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from kvshare.config import YarnConfig
from kvshare.kernels import decode as native_kernels
from kvshare.layers.bound import BoundOp
from kvshare.layers.choice import KernelChoice
from kvshare.precision import version_of

_CPU32 = (torch.device("cpu"), torch.float32)
TABLES_KEPT = 4  # a step rotates at its token positions and at each layer's new entry positions


def rope_frequencies(rope_dim: int, base: float, yarn: YarnConfig | None) -> torch.Tensor:
    """f_i = base^(-2i / rope_dim) for i < rope_dim / 2, blended toward f_i / factor by the YaRN ramp.

    YaRN: c(rot) = rope_dim * ln(orig / (2 pi rot)) / (2 ln base); low = max(floor(c(beta_fast)), 0);
    high = min(ceil(c(beta_slow)), rope_dim - 1) (high += 0.001 when equal);
    ramp_i = clamp((i - low) / (high - low), 0, 1); f_i' = f_i (1 - ramp_i) + (f_i / factor) ramp_i.
    """
    i = torch.arange(rope_dim // 2, dtype=torch.float64)
    freqs = base ** (-2.0 * i / rope_dim)
    if yarn is not None:
        def corr(rot: float) -> float:
            return rope_dim * math.log(yarn.original_max_position_embeddings / (rot * 2 * math.pi)) / (
                2 * math.log(base))

        low = max(math.floor(corr(yarn.beta_fast)), 0)
        high = min(math.ceil(corr(yarn.beta_slow)), rope_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((i - low) / (high - low)).clamp(0.0, 1.0)
        freqs = freqs * (1 - ramp) + freqs / yarn.factor * ramp
    return freqs


class RotaryEmbedding(BoundOp):
    """Rotates the trailing `rope_dim` dims of a tensor at given positions (`rotate`).

    The frequencies are not a buffer, so they never appear in `state_dict()`.
    """

    def __init__(self, rope_dim: int, base: float, yarn: YarnConfig | None) -> None:
        super().__init__()
        self.rope_dim = rope_dim
        self.freqs64 = rope_frequencies(rope_dim, base, yarn)  # float64, never cast by .to(dtype)
        self._freqs: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._tables: dict[tuple, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self._last: tuple | None = None  # (positions, freqs, version, tables) of the latest answer
        self._pair_of: dict[int, tuple[torch.Tensor, ...]] = {}  # id(freqs) -> (freqs, *`_pairs`)

    def _freqs_for(self, x: torch.Tensor) -> torch.Tensor:
        return self._freqs_at((x.device, torch.float64 if x.dtype == torch.float64 else torch.float32))

    def _freqs_at(self, key: tuple[torch.device, torch.dtype]) -> torch.Tensor:
        """The frequencies on device key[0] in dtype key[1] (made once per key)."""
        f = self._freqs.get(key)
        if f is None:
            f = self._freqs[key] = self.freqs64.to(device=key[0], dtype=key[1])
        return f

    def pair_tables(self, positions: torch.Tensor, freqs: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(C, S, -S) [*positions.shape, rope_dim] in `freqs`' dtype (see the module doc)."""
        last = self._last
        if last is not None and last[0] is positions and last[1] is freqs and last[2] == version_of(positions):
            return last[3]  # (a step asks ~15 times for its token positions' tables)
        key = (id(positions), version_of(positions), freqs.dtype, positions.device)
        hit = self._tables.pop(key, None)
        if hit is not None and hit[0] is positions:
            self._tables[key] = hit  # most recently used last: the step's positions stay while entry positions pass
            self._last = (positions, freqs, key[1], hit[1])
            return hit[1]
        pair_freqs, signs, neg_signs = self._pairs(freqs)
        angles = positions.to(freqs.dtype).unsqueeze(-1) * pair_freqs  # each angle twice: (f_0, f_0, f_1, f_1, ...)
        c = angles.cos()
        sin = angles.sin_()
        s = sin * signs  # (-sin, +sin) per pair: the sign flips are exact
        if len(self._tables) >= TABLES_KEPT:
            self._tables.pop(next(iter(self._tables)))
        tables = (c, s, sin.mul_(neg_signs))
        self._tables[key] = (positions, tables)
        self._last = (positions, freqs, key[1], tables)
        return tables

    def _pairs(self, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(each frequency twice [rope_dim], the signs (-1, +1, -1, +1, ...), their negation) in `freqs`'
        dtype and device: the tables' per-element factors, made once per frequency tensor."""
        got = self._pair_of.get(id(freqs))
        if got is None or got[0] is not freqs:
            signs = torch.tensor([-1.0, 1.0], dtype=freqs.dtype, device=freqs.device).repeat(freqs.numel())
            got = self._pair_of[id(freqs)] = (freqs, freqs.repeat_interleave(2), signs, -signs)
        return got[1], got[2], got[3]

    def native_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(C, S, -S) [P, rope_dim] fp32 on the CPU for positions [P]: the tables `rotate`'s native
        path hands `kernels.decode.rope` (shared with it, built once per positions tensor)."""
        return self.pair_tables(positions, self._freqs_at(_CPU32))

    def select(self, choice: KernelChoice) -> Callable[..., Any]:
        return self.forward_native if choice.native else self.forward_torch

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False, *,
               inplace: bool = False) -> torch.Tensor:
        """x[..., -rope_dim:] rotated by +angle (or -angle when `inverse`); other dims untouched.

        `positions` matches x's leading dims (e.g. [T] for x [T, d] or x [T, H, d]); dims of x
        between the positions' dims and the last are broadcast (heads). The tail is rotated in
        the working dtype and cast back to x's dtype once. `inplace`: the caller owns x and
        x's tail is overwritten (x is returned); ignored when autograd records x.
        """
        return self.impl(x, positions, inverse, inplace)

    def forward_native(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False,
                       inplace: bool = False) -> torch.Tensor:
        """`rotate` in one native call (`kernels.decode.rope`, the reference's bits) where it takes x."""
        if positions.dim() == 1 and x.is_contiguous() and not x.requires_grad:
            # the working dtype is fp32, the [P, rd] tables the kernel's layout
            c, s, s_neg = self.pair_tables(positions, self._freqs_at(_CPU32))
            return native_kernels.rope(x, c, s_neg if inverse else s, inplace)
        return self.forward_torch(x, positions, inverse, inplace)

    def forward_torch(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False,
                      inplace: bool = False) -> torch.Tensor:
        """The reference `rotate` (see the module doc)."""
        rd = self.rope_dim
        freqs = self._freqs_for(x)
        c, s, s_neg = self.pair_tables(positions, freqs)
        shape = (*positions.shape, *([1] * (x.dim() - 1 - positions.dim())), rd)
        c, s = c.view(shape), (s_neg if inverse else s).view(shape)
        tail = x[..., -rd:]
        t = tail.to(freqs.dtype)
        if x.requires_grad:  # out= records no autograd graph (same values either way)
            swapped = t.unflatten(-1, (rd // 2, 2)).flip(-1).flatten(-2) * s
            return torch.cat([x[..., :-rd], (t * c + swapped).to(x.dtype)], dim=-1)
        swapped = torch.empty_like(t)  # swap(t) * S, written pair-half by pair-half (cheaper than flip)
        torch.mul(t[..., 1::2], s[..., 0::2], out=swapped[..., 0::2])
        torch.mul(t[..., 0::2], s[..., 1::2], out=swapped[..., 1::2])
        t = t.mul_(c) if t.data_ptr() != tail.data_ptr() else t * c
        if inplace:
            out = x
        else:
            out = torch.empty_like(x)
            out[..., :-rd] = x[..., :-rd]
        torch.add(t, swapped, out=out[..., -rd:])  # computed in the working dtype, cast on store
        return out
