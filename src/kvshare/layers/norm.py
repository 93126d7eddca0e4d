"""RMSNorm (spec/model.md §4.1) as a bound layer: statistics and the weight multiply in fp32, one cast back.

`rms_normalize` / `rms_normalize_as` are the weightless statistics, with an explicit ``native``
argument (the caller's bound choice). The native RMSNorm (`kernels.decode.rms_norm`) gives the
torch code's bits for contiguous bf16 / fp32 CPU rows of at least 8 elements (torch sums shorter
rows with a scalar loop whose order changes with the row count); elsewhere the torch code runs.

`RMSNorm` binds its implementation once (`select`): the native one for a batch-invariant native
choice and an fp32 weight of at least 8 elements (the bf16 model keeps norm weights in fp32,
`model/dtypes.py`); otherwise the torch reference. The native implementation assumes the choice's
invariants (`KernelChoice`: bf16 / fp32 CPU activations, no autograd); rows that are not contiguous
run the reference: the same bits.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from kvshare.kernels import decode as native_kernels
from kvshare.layers.bound import BoundOp
from kvshare.layers.choice import KernelChoice
from kvshare.precision import wide

PIECED_FROM = 1 << 20  # elements (4 MiB of fp32): larger inputs are normalised in pieces
PIECE_ELEMENTS = 1 << 18  # 1 MiB of fp32 temporaries per piece: reused by the allocator, cache-resident


def takes(x: torch.Tensor) -> bool:
    """Whether the native RMSNorm takes rows x of a native-bound caller (contiguous rows of >= 8; the
    caller's choice vouches for bf16 / fp32 CPU tensors without autograd, `KernelChoice`)."""
    return x.dim() > 0 and x.shape[-1] >= 8 and x.is_contiguous()


def _inv_rms(xf: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def rms_normalize(x: torch.Tensor, eps: float, native: bool = False) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim, computed in fp32 (no weight), returned as fp32
    (float64 for a float64 x). `native`: the caller is bound to the native kernels (same bits)."""
    if native and takes(x):
        return native_kernels.rms_norm(x, None, eps, torch.float32)
    xf = wide(x)
    return xf * _inv_rms(xf, eps)


def rms_normalize_as(x: torch.Tensor, eps: float, native: bool = False) -> torch.Tensor:
    """``rms_normalize(x, eps).to(x.dtype)``, the same bits; inputs of PIECED_FROM elements or more
    are computed a piece of rows at a time.

    Every row is normalised on its own, so pieces change no value; they keep the fp32
    temporaries small (a whole [T, H, 512] fp32 temporary is a fresh memory mapping per call,
    whose page faults cost more than the arithmetic). Autograd: the whole-tensor ops.
    """
    if native and takes(x):
        return native_kernels.rms_norm(x, None, eps, x.dtype)
    if x.numel() < PIECED_FROM or x.dim() == 0 or x.requires_grad:
        return rms_normalize(x, eps).to(x.dtype)
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    step = max(1, PIECE_ELEMENTS // max(1, x.shape[-1]))
    for i in range(0, rows.shape[0], step):
        xf = wide(rows[i:i + step])
        if xf is rows or xf.dtype == x.dtype:  # nothing to round: the product goes straight to out
            torch.mul(xf, _inv_rms(xf, eps), out=out[i:i + step])
        else:
            out[i:i + step] = xf * _inv_rms(xf, eps)  # rounded into x's dtype on the copy
    return out.view(x.shape)


class RMSNorm(BoundOp):
    """Weighted RMSNorm; parameter `weight` [dim] (checkpoint name `<prefix>.weight`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def select(self, choice: KernelChoice) -> Callable[..., Any]:
        if not (choice.native and choice.batch_invariant):
            return self.forward_torch
        w = self.weight
        return self.forward_native if w.dtype == torch.float32 and w.numel() >= 8 and w.device.type == "cpu" else self.forward_torch

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        """The reference: ``(rms_normalize(x) * wide(weight)).to(x.dtype)``."""
        return (rms_normalize(x, self.eps) * wide(self.weight)).to(x.dtype)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """`kernels.decode.rms_norm` with the fp32 weight (the reference's bits); the reference for a
        row that is not contiguous (rows of >= 8 were checked at bind time: x's rows are the weight's)."""
        if x.is_contiguous():
            return native_kernels.rms_norm(x, self.weight, self.eps, x.dtype)
        return self.forward_torch(x)
