"""FP8 / FP4 block quantisation (spec/model.md §6).

Every function works on the last dimension in blocks of `block` elements, computes in fp32 and
returns the input's dtype. "Fake-quant" = quantise then dequantise; the packed byte formats in
`cache/formats.py` reuse `fp8_codes` / `fp4_codes` so that packing a fake-quantised row is lossless.

* FP8 (`act_quant`): amax >= 1e-4; scale 2^ceil(log2(amax/448)) (ue8m0) or amax/448; e4m3 cast.
* FP4 e2m1: ue8m0 scale 2^ceil(log2(amax/6)) with amax >= 6*2^-126, or e4m3 scale cast(amax/6)
  with amax >= 6*2^-9; values rounded to nearest even on {0, .5, 1, 1.5, 2, 3, 4, 6}.

`straight_through(fn)` wraps a fake-quant so its gradient is the identity (training).
"""

from __future__ import annotations

from typing import Callable, Literal

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
FP4_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# Midpoints between grid values. At an exact midpoint the even code wins (round half to even):
# 0.25, 1.25, 2.5 and 5 round down; 0.75, 1.75 and 3.5 round up.
_FP4_MIDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])

ScaleFmt = Literal["ue8m0", "e4m3"]


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the quant block {block}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(x)) for positive finite x, exact for every value (subnormals included).

    From the exponent bits, not a floating log2 (fp32 log2 rounds 2^-7 * (1 + 2^-23) to -7):
    ``x = m * 2^e`` with m in [0.5, 1); x is a power of two iff m == 0.5 (then the answer is x),
    otherwise it is 2^e. Values above the largest power of two of the dtype give inf.
    """
    m, e = torch.frexp(x)
    up = torch.ldexp(torch.ones_like(x), e)
    return torch.where(m == 0.5, x, up)


def fp8_codes(x: torch.Tensor, block: int, ue8m0: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise to e4m3. Returns (values as float8_e4m3fn [..., n], scales fp32 [..., n // block])."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4)
    scale = pow2_ceil(amax / FP8_MAX) if ue8m0 else amax / FP8_MAX
    q = (xb / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(x.shape), scale.squeeze(-1)


def fp8_dequant(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    qb = q.float().reshape(*q.shape[:-1], q.shape[-1] // block, block)
    return (qb * scale.unsqueeze(-1)).reshape(q.shape)


def fake_quant_fp8(x: torch.Tensor, block: int, ue8m0: bool = True) -> torch.Tensor:
    """FP8 e4m3 quantise-dequantise in blocks of `block` along the last dim."""
    q, s = fp8_codes(x, block, ue8m0)
    return fp8_dequant(q, s, block).to(x.dtype)


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to the nearest e4m3 value (saturating at 448)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def fp4_scale(amax: torch.Tensor, scale_fmt: ScaleFmt) -> torch.Tensor:
    if scale_fmt == "ue8m0":
        return pow2_ceil(amax.clamp_min(FP4_MAX * 2.0**-126) / FP4_MAX)
    return e4m3_round(amax.clamp_min(FP4_MAX * 2.0**-9) / FP4_MAX)


def fp4_codes(x: torch.Tensor, block: int, scale_fmt: ScaleFmt) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise to e2m1. Returns (codes uint8 in [0, 16): sign bit 3, magnitude index bits 0-2,
    scales fp32 [..., n // block])."""
    xb = _blocks(x, block)
    scale = fp4_scale(xb.abs().amax(dim=-1, keepdim=True), scale_fmt)
    v = (xb / scale).clamp(-FP4_MAX, FP4_MAX)
    mag = v.abs()
    idx = torch.bucketize(mag, _FP4_MIDS.to(mag.device))  # number of midpoints strictly below
    idx = idx + ((mag == 0.75) | (mag == 1.75) | (mag == 3.5)).to(idx.dtype)
    sign = (v < 0) & (idx > 0)
    codes = (idx | (sign.to(idx.dtype) << 3)).to(torch.uint8)
    return codes.reshape(x.shape), scale.squeeze(-1)


def fp4_dequant(codes: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    c = codes.long()
    mag = FP4_GRID.to(codes.device)[c & 7]
    val = torch.where((c & 8) > 0, -mag, mag)
    vb = val.reshape(*codes.shape[:-1], codes.shape[-1] // block, block)
    return (vb * scale.unsqueeze(-1)).reshape(codes.shape)


def fake_quant_fp4(x: torch.Tensor, block: int, scale_fmt: ScaleFmt = "ue8m0") -> torch.Tensor:
    """FP4 e2m1 quantise-dequantise in blocks of `block` along the last dim."""
    codes, s = fp4_codes(x, block, scale_fmt)
    return fp4_dequant(codes, s, block).to(x.dtype)


class _STE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        return fn(x.detach())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def straight_through(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Apply a fake-quant `fn` in the forward pass with an identity gradient (training)."""
    if x.requires_grad:
        return _STE.apply(x, fn)
    return fn(x)
