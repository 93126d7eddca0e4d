"""RMSNorm (spec/model.md §4.1): statistics and the weight multiply in fp32, one cast back."""

from __future__ import annotations

import torch
from torch import nn
from kvshare.kernels import decode as native
from kvshare.ops import invariant
from kvshare.precision import wide


def _native(x: torch.Tensor) -> bool:
    """Whether the native RMSNorm (`kernels.decode.rms_norm`, the same bits) serves x: inside a
    batch-invariant forward, a contiguous bf16 / fp32 CPU tensor of rows of at least 8 (torch sums
    shorter rows with a scalar loop whose order changes with the row count) without autograd."""
    return invariant.is_on() and x.dim() > 0 and x.shape[-1] >= 8 and native.serves(x) and x.is_contiguous()


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim, computed in fp32 (no weight), returned as fp32."""
    if _native(x):
        return native.rms_norm(x, None, eps, torch.float32)
    xf = wide(x)
    return xf * _inv_rms(xf, eps)


def _inv_rms(xf: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


PIECED_FROM = 1 << 20  # elements (4 MiB of fp32): larger inputs are normalised in pieces
PIECE_ELEMENTS = 1 << 18  # 1 MiB of fp32 temporaries per piece: reused by the allocator, cache-resident


def rms_normalize_as(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_normalize(x, eps).to(x.dtype)``, the same bits; inputs of PIECED_FROM elements or more
    are computed a piece of rows at a time.

    Every row is normalised on its own, so pieces change no value; they keep the fp32
    temporaries small (a whole [T, H, 512] fp32 temporary is a fresh memory mapping per call,
    whose page faults cost more than the arithmetic). Autograd: the whole-tensor ops.
    """
    if _native(x):
        return native.rms_norm(x, None, eps, x.dtype)
    if x.numel() < PIECED_FROM or x.dim() == 0 or torch.is_grad_enabled() and x.requires_grad:
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


class RMSNorm(nn.Module):
    """Weighted RMSNorm; parameter `weight` [dim] (checkpoint name `<prefix>.weight`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if invariant.is_on() and self.weight.dtype == torch.float32 and _native(x) and not (torch.is_grad_enabled() and self.weight.requires_grad):
            return native.rms_norm(x, self.weight, self.eps, x.dtype)
        return (rms_normalize(x, self.eps) * wide(self.weight)).to(x.dtype)
