"""The accumulation dtype of the model's "compute in fp32" steps.

The spec computes norms, compressors, mHC, the MoE gate and attention in fp32. A model run in
float64 (the exactness tests) must stay float64 there: rounding to fp32 would bring back the
batch-shape-dependent matmul noise that float64 is meant to push below every FP8/FP4 rounding
boundary. So "fp32" means "fp32 or wider" throughout the model.
"""

from __future__ import annotations

import torch


def wide(x: torch.Tensor) -> torch.Tensor:
    """`x` as fp32, or unchanged if it is already float64."""
    return x if x.dtype == torch.float64 else x.float()


def version_of(x: torch.Tensor) -> int:
    """`x`'s in-place version counter, or -1 for an inference tensor (which has none).

    Caches keyed on (tensor, version) use it; an inference tensor's cache entry is trusted
    until the tensor itself changes identity / storage."""
    return -1 if x.is_inference() else x._version
