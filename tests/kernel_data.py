"""Test data for the kernel tests: values whose products and sums are exact in fp32, and a
float64 emulation of the kernels' documented reduction order (kvshare/kernels/__init__.py)."""

from __future__ import annotations

import torch

from kvshare.kernels import Packed, dequantize
from kvshare.kernels.packed import row_exponents


def fp8_valued(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 [m, k]: multiples of 1/8 below 2 (e4m3 values with <= 4 significant bits) times a
    power-of-two row scale in [1/4, 1]: FP8-valued, granularity 2^-5, |x| <= 1.875."""
    v = torch.randint(-15, 16, (m, k), generator=gen).float() / 8
    s = torch.exp2(-torch.randint(0, 3, (m, 1), generator=gen).float())
    return (v * s).to(torch.bfloat16)


def e4m3_codes(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """e4m3 codes [n, k] with values in multiples of 1/8 below 2 (exact in the products below)."""
    return (torch.randint(-15, 16, (n, k), generator=gen).float() / 8).to(torch.float8_e4m3fn)


def pow2_scales(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """ue8m0 scales 2^e, e in [-3, 0]."""
    return torch.exp2(-torch.randint(0, 4, shape, generator=gen).float()).to(torch.float8_e8m0fnu)


def fp4_pairs(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random packed e2m1 pairs [n, k / 2] (int8, low nibble = even k)."""
    return torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8).view(torch.int8)


def exact_bf16_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 [n, k]: integers in [-31, 31] / 32 times a power-of-two row scale in [1/8, 1]."""
    v = torch.randint(-31, 32, (n, k), generator=gen).float() / 32
    return (v * torch.exp2(-torch.randint(0, 4, (n, 1), generator=gen).float())).to(torch.bfloat16)


def _r32(t: torch.Tensor) -> torch.Tensor:
    return t.float().double()


def emulate(x: torch.Tensor, p: Packed) -> torch.Tensor:
    """The documented order for bf16-activation formats, in float64 with fp32 rounding after every
    add: per lane, pairs in increasing order, odd k then even k; FP8 / FP4: per scale block from
    0, then total = fp32(total + block_sum * 2^e). Returns the fp32 totals [M, N] (before bf16).
    Exact emulation while every product (<= 16 significant bits) plus a partial sum fits float64."""
    w = dequantize(p).double()
    m, n, k = x.shape[0], p.n, p.k
    kp = p.kp
    xs = torch.zeros(m, kp, dtype=torch.float64)
    xs[:, :k] = x.double()
    ws = torch.zeros(n, kp, dtype=torch.float64)
    if p.fmt == "bf16":
        ws[:, :k] = w
        scale = None
    else:  # the codes (unscaled) and the per-(row, block) scale
        scale = torch.exp2(row_exponents(p).double())
        ws[:, :k] = w / scale.repeat_interleave(p.block, dim=1)[:, :k]
    block = p.block or kp
    total = torch.zeros(m, n, dtype=torch.float64)
    for b0 in range(0, kp, block):
        acc = total if scale is None else torch.zeros(m, n, dtype=torch.float64)
        for j in range(b0, min(b0 + block, kp), 2):
            acc = _r32(acc + xs[:, None, j + 1] * ws[None, :, j + 1])
            acc = _r32(acc + xs[:, None, j] * ws[None, :, j])
        total = acc if scale is None else _r32(total + acc * scale[None, :, b0 // block])
    return total.float()
