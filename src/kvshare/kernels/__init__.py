"""kvshare's own CPU GEMM kernels: weights in bf16, fp32, FP8 (e4m3, block scales) or FP4 (e2m1,
ue8m0 per 32 inputs) kept in their packed form, every output summed in a fixed order.

API::

    p = kernels.pack_fp8(codes, scale, (128, 128))   # or pack_fp4 / pack_bf16 / pack_fp32
    y = kernels.linear(x, p)                          # x [..., K] -> y [..., N], dtype of x

**The reduction-order contract** (what batch invariance builds on): y[m, n] is accumulated in an
order that depends only on K and the weight format, never on the number of rows in the call, the
row's position, the other rows or the thread count. Native paths (csrc/gemm_body.h): lane-wise
over k pairs (odd k, then even k; exact bf16 products, one rounded fp32 add each); FP8 / FP4 sum
each scale block from zero and add block_sum * 2^e to the total; fp32 weights: per block of 32
inputs one fma per k from zero, then total += block sum.
Output = activation dtype (bf16: round-to-nearest-even of the fp32 total).

Paths (`isa()`): "amx" (default where available: AMX-BF16 tiles of 32 rows, rows zero-padded,
each output taking the same TDPBF16PS steps over K whatever the call (K chunks above 32 rows keep
the totals in fp32 between them), so row-invariant by construction; FP8 / FP4 codes are scaled to
bf16 before the tiles, exactly; the order inside TDPBF16PS is the hardware's, so its bits differ
from "avx512" in the last place on inexact sums; weights whose K is not a multiple of 32 take the
AVX-512 path). "avx512" (AVX-512 BF16) and "avx2" (AVX2 + FMA) give the same bits except where
a bf16 product or partial sum is subnormal (``vdpbf16ps`` flushes those to zero); "torch"
(`fallback.py`) is row-invariant too and equal to them where the arithmetic is exact.
"""

from __future__ import annotations

import torch

from kvshare.kernels import fallback
from kvshare.kernels.build import best_isa, loaded, supported_isas
from kvshare.kernels.packed import (FORMAT_ID, Packed, dequantize, pack_bf16, pack_fp4, pack_fp8, pack_fp32,
                                    scale_exponents)
from kvshare.kernels.ops import ops

__all__ = ["Packed", "available", "dequantize", "isa", "linear", "linear_checked", "pack", "pack_bf16", "pack_fp32", "pack_fp4",
           "pack_fp8", "scale_exponents", "supported_isas"]


def available() -> bool:
    """Whether a native code path serves `linear` (False: the pure-torch path does)."""
    return best_isa() != "torch"


def isa() -> str:
    """The code path `linear` uses by default: "avx512", "avx2" or "torch"."""
    return best_isa()


def pack(w: torch.Tensor) -> Packed:
    """`pack_fp32` for an fp32 (or wider) weight, `pack_bf16` otherwise."""
    return pack_fp32(w) if w.dtype in (torch.float32, torch.float64) else pack_bf16(w)


def linear_checked(x: torch.Tensor, p: Packed) -> torch.Tensor:
    """`linear(x, p)` for a caller that has checked ``x.dtype == p.act_dtype``: one native call for a
    2-D x on the default path (the `gemm` op checks x's shape against the weight's)."""
    if x.dim() == 2 and best_isa() != "torch":  # (a native path: the library is loaded)
        return ops.gemm(x, p.data, p.exps, FORMAT_ID[p.fmt], p.n, p.k, p.kp, p.block, best_isa(), False)
    return linear(x, p)


def linear(x: torch.Tensor, p: Packed, isa: str | None = None, fp32_totals: bool = False) -> torch.Tensor:
    """``x @ W^T`` for x [..., K] in `p.act_dtype` (see the module doc for the order); `isa` forces a
    code path ("avx512", "avx2", "torch"; default `isa()`). `fp32_totals` (native paths): return the
    fp32 sums before the bf16 rounding (tests check the order with them)."""
    if x.dtype != p.act_dtype:
        raise ValueError(f"kernels.linear: x has dtype {x.dtype}, the {p.fmt} weight takes {p.act_dtype}")
    if x.shape[-1] != p.k:
        raise ValueError(f"kernels.linear: x has {x.shape[-1]} inputs (last dim), the weight {p.k}")
    flat = x.dim() == 2  # the common case: no reshapes (each a torch call)
    x2 = x if flat else x.reshape(-1, p.k)
    path = isa or best_isa()
    if path == "torch":
        if fp32_totals:
            raise ValueError("kernels.linear: fp32_totals needs a native path")
        y = fallback.linear(x2, p)
    else:
        if not loaded():
            raise RuntimeError(f"kernels.linear: isa {path!r} asked for, but the native library is unavailable")
        y = ops.gemm(x2, p.data, p.exps, FORMAT_ID[p.fmt], p.n, p.k, p.kp, p.block, path, fp32_totals)
    return y if flat else y.reshape(*x.shape[:-1], p.n)
