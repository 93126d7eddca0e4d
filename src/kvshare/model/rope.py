"""Interleaved partial RoPE with optional YaRN (spec/model.md §4.2).

Only the TRAILING `qk_rope_head_dim` dims of a vector rotate; adjacent pairs (2i, 2i+1) of that
tail are complex numbers multiplied by exp(i * pos * f_i). Ratio-0 layers use `rope_theta` without
YaRN; every ratio > 0 layer (Full, Reindex and Reuse alike) uses `compress_rope_theta` with YaRN
when the config has it. No YaRN magnitude scaling (mscale) is applied anywhere.

Angles are computed on the fly from the positions (no table of max_position_embeddings rows) in
fp32, or in float64 for a float64 input (`precision.wide`: exactness runs stay float64); the
rotation runs in that dtype and the result is cast back to the input dtype once. Frequencies are
kept in float64 outside the module's buffers, so ``model.to(bfloat16)`` cannot round them.
The cos/sin table of the last positions tensor is kept per working dtype (keyed by that tensor's
identity and version, holding a reference so its memory cannot be reused), so the q, kv and
output rotations of a step build it once per RoPE flavour instead of once per call; the values
are the same bits.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvshare.config import YarnConfig
from kvshare.precision import version_of


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


class RotaryEmbedding(nn.Module):
    """Rotates the trailing `rope_dim` dims of a tensor at given positions.

    The frequency buffer is not persistent, so it never appears in `state_dict()`.
    """

    def __init__(self, rope_dim: int, base: float, yarn: YarnConfig | None) -> None:
        super().__init__()
        self.rope_dim = rope_dim
        self.freqs64 = rope_frequencies(rope_dim, base, yarn)  # float64, never cast by .to(dtype)
        self._freqs: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._table: tuple[torch.Tensor, int, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def _freqs_for(self, x: torch.Tensor) -> torch.Tensor:
        dt = torch.float64 if x.dtype == torch.float64 else torch.float32
        key = (x.device, dt)
        f = self._freqs.get(key)
        if f is None:
            f = self._freqs[key] = self.freqs64.to(device=x.device, dtype=dt)
        return f

    def cos_sin(self, positions: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [*positions.shape, rope_dim / 2] in `freqs`' dtype of the angles at `positions`."""
        t = self._table
        if (t is not None and t[0] is positions and t[1] == version_of(positions) and t[2] == freqs.dtype
                and t[3].device == positions.device):
            return t[3], t[4]
        angles = positions.to(freqs.dtype).unsqueeze(-1) * freqs
        cos, sin = angles.cos(), angles.sin()
        self._table = (positions, version_of(positions), freqs.dtype, cos, sin)
        return cos, sin

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x[..., -rope_dim:] rotated by +angle (or -angle when `inverse`); other dims untouched.

        `positions` matches x's leading dims (e.g. [T] for x [T, d] or x [T, H, d]); dims of x
        between the positions' dims and the last are broadcast (heads).
        """
        rd = self.rope_dim
        freqs = self._freqs_for(x)
        cos, sin = self.cos_sin(positions, freqs)
        extra = x.dim() - 1 - positions.dim()
        cos = cos.view(*positions.shape, *([1] * extra), rd // 2)
        sin = sin.view(*positions.shape, *([1] * extra), rd // 2)
        if inverse:
            sin = -sin
        tail = x[..., -rd:].to(freqs.dtype).unflatten(-1, (rd // 2, 2))
        a, b = tail[..., 0], tail[..., 1]
        rotated = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
        return torch.cat([x[..., :-rd], rotated.to(x.dtype)], dim=-1)
