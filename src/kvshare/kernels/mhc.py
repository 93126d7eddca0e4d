"""A sublayer's mHC work in one native call (csrc/mhc.cpp); `layers/mhc.FusedMhc` binds it.

In a batch-invariant native forward, entering a sublayer used to be five native calls with Python
between them (`layers/mhc_torch.py`: the RMS statistic of the flattened streams, the fp32 mix GEMM,
`mhc_post`, `mhc_collapse`, then the sublayer's RMSNorm), and leaving it one more (`mhc_expand`).
These functions make the same calls, in the same order, on the same buffers, from C++:

* `enter(h, ...)` -> (x, pre, post, comb): the sublayer's normed input x [T, D] (h's dtype) and its
  mixes, x collapsed with `collapse_pre` (V4.1: the previous sublayer's `pre`) or, when None, with
  the mix's own `pre` (V4);
* `boundary(h, y, post, comb, ...)` -> (h', x, pre, post, comb): expand the finished sublayer's
  output y into the streams (h' is the block's residual), then `enter` the next sublayer on h';
* `leave(h, y, post, comb)` -> h': the expand of a block's last sublayer (`decode.mhc_expand`'s
  kernel, with no torch calls around it: y must have h's dtype);
* `head(h, ...)` -> x: the model's tail, the final collapse (V4: with the `hc_head` mixes' sigmoid
  pre; V4.1: with the last sublayer's pre) and the final RMSNorm.

So every output has the bits of the unfused native calls, hence of the torch path
(tests/test_mhc_fused.py asserts both, and the spec's formulas in float64 within stated errors).
The mix weight `fn` is handed over as its fp32 pack (`kernels.pack_fp32`, what `ops.invariant.
row_linear` multiplies by); base, scale and the norm weight may be bf16 (widened exactly).

A model bound without ``KernelChoice.fused_mhc`` (``KVSHARE_NATIVE_MHC=off``) makes the unfused
calls instead (`layers/mhc.NativeMhc`, the same bits).
"""

from __future__ import annotations

import torch

from kvshare.kernels.build import best_isa
from kvshare.kernels.packed import Packed
from kvshare.kernels.ops import ops


def _fp32_pack(fn: Packed | None) -> torch.Tensor:
    if fn is None or fn.fmt != "fp32":
        raise ValueError(f"kernels.mhc: the mix weight fn must be packed as fp32, got {None if fn is None else fn.fmt}")
    return fn.data


def enter(h: torch.Tensor, fn: Packed, base: torch.Tensor, scale: torch.Tensor, collapse_pre: torch.Tensor | None,
          norm_w: torch.Tensor, norm_eps: float, rms_eps: float, hc_eps: float,
          iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [T, D] in h's dtype, pre [T, hc], post [T, hc], comb [T, hc, hc] fp32) for the sublayer that
    reads streams h [T, hc, D] (bf16 / fp32): mixes from `fn` (fp32 pack of [(2 + hc) hc, hc D]),
    `base`, `scale`; x = RMSNorm(collapse(h, collapse_pre or pre), norm_w, norm_eps)."""
    return ops.mhc_enter(h, _fp32_pack(fn), base, scale, collapse_pre, norm_w, norm_eps, rms_eps, hc_eps,
                         iters, best_isa())


def boundary(h: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: Packed, base: torch.Tensor,
             scale: torch.Tensor, collapse_pre: torch.Tensor | None, norm_w: torch.Tensor, norm_eps: float,
             rms_eps: float, hc_eps: float, iters: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h' = expand(h, y, post, comb) [T, hc, D], then `enter`'s four outputs on h'); y [T, D] in h's dtype."""
    return ops.mhc_boundary(h, y, post, comb, _fp32_pack(fn), base, scale, collapse_pre, norm_w, norm_eps,
                            rms_eps, hc_eps, iters, best_isa())


def leave(h: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """[T, hc, D] = post_k y + sum_j comb[j, k] h_j in h's dtype (`decode.mhc_expand`); y [T, D] in h's dtype."""
    return ops.mhc_leave(h, y, post, comb)


def head(h: torch.Tensor, pre: torch.Tensor | None, norm_w: torch.Tensor, norm_eps: float, rms_eps: float,
         hc_eps: float, fn: Packed | None = None, base: torch.Tensor | None = None,
         scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, D] in h's dtype = RMSNorm(collapse(h, pre), norm_w, norm_eps) with `pre` [T, hc] given (V4.1)
    or, when `fn` (fp32 pack of [hc, hc D]), `base` [hc] and `scale` [1] are given instead (V4),
    pre = sigmoid(fn . rms(flat h) * scale + base) + hc_eps."""
    return ops.mhc_head(h, None if fn is None else _fp32_pack(fn), base, scale, pre, norm_w, norm_eps,
                        rms_eps, hc_eps, best_isa())
