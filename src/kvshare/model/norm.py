"""RMSNorm (spec/model.md §4.1): statistics and the weight multiply in fp32, one cast back."""

from __future__ import annotations

import torch
from torch import nn
from kvshare.precision import wide


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim, computed in fp32 (no weight), returned as fp32."""
    xf = wide(x)
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """Weighted RMSNorm; parameter `weight` [dim] (checkpoint name `<prefix>.weight`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalize(x, self.eps) * wide(self.weight)).to(x.dtype)
