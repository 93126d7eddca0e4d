"""Transitional entry points for the model files not yet bound (issue 34; owner of the callers: `attn`).

`model/attention.py`, `model/indexer.py` and `model/compressor.py` still decide per call, from the
thread's batch-invariant flag (`ops.invariant.active`, entered by `Transformer.forward`) and
`kernels.decode.serves`, which implementation runs. They reach the bound layers' functions through
the old names below, which make that decision for them and pass it on explicitly. When those files
pass their own bound choice, this module (and `Transformer.forward`'s `invariant.active` /
`forward_scope` wrapper) is deleted.
"""

from __future__ import annotations

import torch

from kvshare.kernels import decode as native_kernels
from kvshare.layers import norm
from kvshare.ops import invariant


def native_now(x: torch.Tensor) -> bool:
    """The old per-call answer: inside a batch-invariant forward whose native kernels serve x."""
    return invariant.is_on() and native_kernels.serves(x)


def rms_normalize_as(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`layers.norm.rms_normalize_as` with ``native`` decided per call (see module doc)."""
    return norm.rms_normalize_as(x, eps, native=native_now(x))
