"""FP8 / FP4 fake-quantisation of activations (spec/model.md §6), with the native kernel chosen by the caller.

`QuantMode` is the model's switchboard of which tensors are rounded (shared by every module of one
`Transformer`); `fit_block` the block fitting of tiny widths. `fp8_round` / `fp4_round` /
`act_quant` take ``native`` explicitly: the caller's bound choice (`KernelChoice.native`). The
native kernels (`kernels.decode.fake_quant_fp8`, `kernels.rows.fake_quant_fp4`) give the torch
code's bits; a native caller vouches for bf16 / fp32 CPU tensors without autograd (`KernelChoice`);
an FP8 width that is not a multiple of the block runs the torch code (`kvshare.quant`, identity
gradient), the same bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvshare.kernels import decode as native_kernels
from kvshare.kernels import rows as native_rows
from kvshare.quant import ScaleFmt, fake_quant_fp4, fake_quant_fp8, straight_through


@dataclass
class QuantMode:
    """Which fake-quant groups are on.

    ``cache``: window and compressed KV rows; ``index``: index keys and queries (and V4's Hadamard);
    ``act``: FP8 rounding of the inputs of FP8/FP4-weight GEMMs.
    """

    cache: bool = True
    index: bool = True
    act: bool = True

    @classmethod
    def of(cls, q: "bool | QuantMode") -> "QuantMode":
        """`True` / `False` mean all on / all off; a QuantMode is copied."""
        if isinstance(q, QuantMode):
            return cls(q.cache, q.index, q.act)
        return cls(bool(q), bool(q), bool(q))

    @property
    def any(self) -> bool:
        return self.cache or self.index or self.act


def fit_block(width: int, block: int) -> int:
    """`block` if it divides `width`, else the largest power of two dividing `width` (at most `block`)."""
    if width % block == 0:
        return block
    return math.gcd(width, block)


def fp8_round(x: torch.Tensor, block: int, native: bool = False) -> torch.Tensor:
    """`fake_quant_fp8(x, block, ue8m0=True)` (identity gradient), in one native call where `native`
    and the kernel takes x (the same bits)."""
    if native:
        y = native_kernels.fake_quant_fp8(x, block)  # None: a width the kernel does not take
        if y is not None:
            return y
    return straight_through(lambda t: fake_quant_fp8(t, block, ue8m0=True), x)


def fp4_round(x: torch.Tensor, block: int, scale_fmt: ScaleFmt, native: bool = False) -> torch.Tensor:
    """`fake_quant_fp4(x, block, scale_fmt)` (identity gradient), in one native call where `native`
    and the kernel takes x (the same bits)."""
    if native and not x.requires_grad:  # (autograd: the straight-through torch code)
        return native_rows.fake_quant_fp4(x, block, scale_fmt)
    return straight_through(lambda t: fake_quant_fp4(t, block, scale_fmt), x)


def act_quant(x: torch.Tensor, block: int, native: bool = False) -> torch.Tensor:
    """FP8 e4m3 (ue8m0 scales) rounding of a GEMM input along its last dim (block fitted to its width)."""
    return fp8_round(x, fit_block(x.shape[-1], block), native)
