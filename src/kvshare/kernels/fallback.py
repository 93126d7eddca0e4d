"""The pure-torch path: used where the native library cannot be built or the CPU lacks AVX2.

Row-count invariance by construction: every row is its own ``F.linear`` call of shape [1, K] on
the same dequantised weight, so a row's bits depend neither on how many rows the call had nor on
its position (one GEMV shape, one code path). The weight is dequantised once per `Packed` and
cached on it (bf16 for bf16 / FP8 / FP4: exact; fp32 for fp32), so on this path FP8 / FP4 weights
take bf16 memory in addition to their packed bytes.

Where it can differ from the native kernels: torch's GEMV sums K in its own order (and may split
K over threads), so on inexact sums the last bit can differ from the native path's fixed order;
where every partial sum is exact (e.g. FP8-valued activations times FP8/FP4 weights of bounded
range) the results are bitwise equal (tests/test_kernels_exact.py). A dequantised weight that is
subnormal in bf16 (a code times a scale below about 2^-120) is flushed to zero by oneDNN's bf16
GEMM, where the native paths apply the scale in fp32 and keep it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvshare.kernels.packed import Packed, dequantize


def weight_of(p: Packed) -> torch.Tensor:
    """The dequantised weight of `p`, built on first use and kept on `p`."""
    w = getattr(p, "_fallback_weight", None)
    if w is None:
        w = dequantize(p)
        p._fallback_weight = w  # type: ignore[attr-defined]
    return w


def rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ w^T`` for a dense weight w [N, K], one identical [1, K] call per row."""
    if x.shape[0] == 0:
        return x.new_empty(0, w.shape[0])
    # each row copied to a fresh (64-byte aligned) buffer: BLAS kernels peel a vector loop by the
    # row's address, so a view's offset inside x would change the summation order (seen on AMD EPYC
    # for fp32: the same row gave other bits at another offset)
    return torch.cat([F.linear(x[i: i + 1].clone(), w) for i in range(x.shape[0])])


def linear(x: torch.Tensor, p: Packed) -> torch.Tensor:
    """``x [M, K] @ W^T`` one row at a time (see module doc)."""
    return rows(x, weight_of(p))
