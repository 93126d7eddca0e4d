"""A block's mHC (spec/model.md §7.1) as one bound layer: enter a sublayer, cross the boundary between
two sublayers, leave the block, and the model's head collapse.

`Mhc` is the layer; `Block.forward` and `Transformer.forward` (model/deepseek.py) call

* ``enter(h, w, norm, prev_pre) -> (x, mix)``: the first sublayer's mixes from streams h [T, hc, D]
  and its normed input x [T, D] = norm(collapse(h, pre)) (V4.1 collapses with `prev_pre`, the
  previous sublayer's pre; V4 with the mix's own);
* ``boundary(h, y, done, w, norm) -> (h', x, mix)``: expand the finished sublayer's output y into
  the streams with `done`'s post / comb, then `enter` the next sublayer on h' (V4.1: collapsing
  with `done.pre`);
* ``leave(h, y, done) -> h'``: the block's last expand;
* ``head(h, pre, norm, w) -> x``: the final collapse (V4: with the `hc_head` mixes' sigmoid pre from
  `w`; V4.1: with the last sublayer's `pre`) and the final RMSNorm.

Which implementation runs is bound once (`select`), all with the same bits:

| choice | implementation |
|---|---|
| batch-invariant, native, fused_mhc (hidden >= 8) | `FusedMhc`: one native call per boundary (`kernels/mhc.py`) |
| batch-invariant, native | `NativeMhc`: the unfused native calls (`kernels/decode.py`) |
| batch-invariant, torch | `TorchMhc(invariant=True)`: row-invariant products and sigmoids |
| not batch-invariant (the reference too) | `ChunkedMhc`: token-chunked passes (`layers/mhc_chunked.py`) for big steps without autograd, else `TorchMhc` |

`TorchMhc()` is the reference (`layers/mhc_torch.py`, autograd-capable) the tests compare with.
Per-call facts a faster implementation cannot take (a sublayer output in another dtype, a step too
small to chunk, autograd) run the reference's calls inside it: the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvshare.kernels import decode as native_kernels
from kvshare.kernels import mhc as fused_kernels
from kvshare.kernels.packed import Packed
from kvshare.layers.bound import BoundOp
from kvshare.layers.choice import KernelChoice
from kvshare.layers.mhc_chunked import HcMix, HcWeights, hc_boundary, hc_enter, worth_chunking
from kvshare.layers.mhc_torch import hc_collapse, hc_expand, hc_head_pre, hc_mix, hc_post_comb, hc_pre_of
from kvshare.layers.norm import RMSNorm, rms_normalize
from kvshare.ops.invariant import native_pack, pointwise, row_linear
from kvshare.precision import wide

__all__ = ["ChunkedMhc", "FusedMhc", "HcMix", "HcWeights", "Mhc", "NativeMhc", "TorchMhc"]


@dataclass
class Mix(HcMix):
    """`HcMix` plus ``wide(h)`` of the streams it was computed from, when an implementation made it
    (the torch reference converts the streams once per sublayer: mix, collapse and expand share it)."""

    hw: torch.Tensor | None = None


class TorchMhc:
    """The reference: `layers/mhc_torch.py`'s functions (``invariant``: row-invariant products / sigmoids)."""

    def __init__(self, invariant: bool = False) -> None:
        self.invariant = invariant

    def enter(self, h: torch.Tensor, w: HcWeights, norm: RMSNorm, collapse_pre: torch.Tensor | None
              ) -> tuple[torch.Tensor, Mix]:
        hw = wide(h)
        pre, post, comb = hc_mix(h, w.fn, w.base, w.scale, rms_eps=w.rms_eps, hc_eps=w.hc_eps, iters=w.iters, hw=hw,
                                 invariant=self.invariant)
        x = hc_collapse(h, pre if collapse_pre is None else collapse_pre, hw)
        return norm(x), Mix(pre, post, comb, hw)

    def boundary(self, h: torch.Tensor, y: torch.Tensor, done: HcMix, w: HcWeights, norm: RMSNorm,
                 collapse_pre: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, Mix]:
        h = self.leave(h, y, done)
        x, mix = self.enter(h, w, norm, collapse_pre)
        return h, x, mix

    def leave(self, h: torch.Tensor, y: torch.Tensor, done: HcMix) -> torch.Tensor:
        return hc_expand(h, y, done.post, done.comb, getattr(done, "hw", None))

    def head(self, h: torch.Tensor, pre: torch.Tensor | None, norm: RMSNorm, w: HcWeights | None,
             rms_eps: float, hc_eps: float) -> torch.Tensor:
        if w is not None:
            pre = hc_head_pre(h, w.fn, w.base, w.scale, rms_eps=w.rms_eps, hc_eps=w.hc_eps, invariant=self.invariant)
        assert pre is not None
        return norm(hc_collapse(h, pre))


class NativeMhc(TorchMhc):
    """The reference's calls made by the native decode kernels (batch-invariant: `kernels/decode.py`'s
    RMS statistic, `mhc_post`, `mhc_collapse`, `mhc_expand`; the mix product by `row_linear`). They
    read the streams in their own dtype, so no ``wide(h)`` is made."""

    def __init__(self) -> None:
        super().__init__(invariant=True)

    def _mix(self, h: torch.Tensor, w: HcWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, hc, _ = h.shape
        m = row_linear(rms_normalize(h.reshape(t, -1), w.rms_eps, native=True), wide(w.fn))
        if m.dtype == torch.float32:  # one call: sigmoids, softmax, Sinkhorn
            return native_kernels.mhc_post(m, w.base, w.scale, hc, w.hc_eps, w.iters)
        post, comb = hc_post_comb(m, w.base, w.scale, hc, w.hc_eps, w.iters, True)
        return hc_pre_of(m, w.base, w.scale, hc, w.hc_eps, True), post, comb

    @staticmethod
    def _collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return native_kernels.mhc_collapse(h, pre) if pre.dtype == torch.float32 else hc_collapse(h, pre)

    def enter(self, h: torch.Tensor, w: HcWeights, norm: RMSNorm, collapse_pre: torch.Tensor | None
              ) -> tuple[torch.Tensor, Mix]:
        pre, post, comb = self._mix(h, w)
        return norm(self._collapse(h, pre if collapse_pre is None else collapse_pre)), Mix(pre, post, comb)

    def leave(self, h: torch.Tensor, y: torch.Tensor, done: HcMix) -> torch.Tensor:
        if y.dtype == h.dtype and done.comb.dtype == torch.float32:
            return native_kernels.mhc_expand(h, y, done.post, done.comb)
        return hc_expand(h, y, done.post, done.comb)

    def head(self, h: torch.Tensor, pre: torch.Tensor | None, norm: RMSNorm, w: HcWeights | None,
             rms_eps: float, hc_eps: float) -> torch.Tensor:
        if w is not None:
            m = row_linear(rms_normalize(h.reshape(h.shape[0], -1), w.rms_eps, native=True), wide(w.fn))
            pre = pointwise(torch.sigmoid, m * wide(w.scale) + wide(w.base), True) + w.hc_eps
        assert pre is not None
        return norm(self._collapse(h, pre))


def fp32_pack(fn: torch.Tensor) -> Packed | None:
    """The fp32 pack `row_linear` multiplies a mix by, ``native_pack(wide(fn))``: an fp32 parameter's
    own pack (without the `wide` call), a bf16 one's widened copy."""
    return native_pack(fn if fn.dtype == torch.float32 else wide(fn))


class FusedMhc(NativeMhc):
    """`NativeMhc`'s calls made from C++, one call per sublayer boundary (`kernels/mhc.py`: the same
    calls in the same order on the same buffers, so the same bits). A sublayer output in another
    dtype than the streams takes the unfused expand first (as the unfused path would)."""

    def enter(self, h: torch.Tensor, w: HcWeights, norm: RMSNorm, collapse_pre: torch.Tensor | None
              ) -> tuple[torch.Tensor, Mix]:
        x, pre, post, comb = fused_kernels.enter(h, fp32_pack(w.fn), w.base, w.scale, collapse_pre, norm.weight,
                                                 norm.eps, w.rms_eps, w.hc_eps, w.iters)
        return x, Mix(pre, post, comb)

    def leave(self, h: torch.Tensor, y: torch.Tensor, done: HcMix) -> torch.Tensor:
        if y.dtype != h.dtype:
            return hc_expand(h, y, done.post, done.comb)
        return fused_kernels.leave(h, y, done.post, done.comb)

    def boundary(self, h: torch.Tensor, y: torch.Tensor, done: HcMix, w: HcWeights, norm: RMSNorm,
                 collapse_pre: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, Mix]:
        if y.dtype != h.dtype:
            h = hc_expand(h, y, done.post, done.comb)
            x, mix = self.enter(h, w, norm, collapse_pre)
            return h, x, mix
        h, x, pre, post, comb = fused_kernels.boundary(h, y, done.post, done.comb, fp32_pack(w.fn), w.base, w.scale,
                                                       collapse_pre, norm.weight, norm.eps, w.rms_eps, w.hc_eps,
                                                       w.iters)
        return h, x, Mix(pre, post, comb)

    def head(self, h: torch.Tensor, pre: torch.Tensor | None, norm: RMSNorm, w: HcWeights | None,
             rms_eps: float, hc_eps: float) -> torch.Tensor:
        if w is None:
            return fused_kernels.head(h, pre, norm.weight, norm.eps, rms_eps, hc_eps)
        return fused_kernels.head(h, None, norm.weight, norm.eps, w.rms_eps, w.hc_eps, fp32_pack(w.fn), w.base, w.scale)


class ChunkedMhc(TorchMhc):
    """The batched inference passes of `layers/mhc_chunked.py` (each boundary reads the streams once,
    in token chunks) for steps big enough to gain (`worth_chunking`) and without autograd; the
    reference otherwise. The same bits either way (tests/test_mhc_chunked.py)."""

    @staticmethod
    def _chunks(h: torch.Tensor) -> bool:
        return not h.requires_grad and worth_chunking(*h.shape)

    def enter(self, h: torch.Tensor, w: HcWeights, norm: RMSNorm, collapse_pre: torch.Tensor | None
              ) -> tuple[torch.Tensor, Mix]:
        if not self._chunks(h):
            return super().enter(h, w, norm, collapse_pre)
        x, mix = hc_enter(h, w, collapse_pre)
        return norm(x), Mix(mix.pre, mix.post, mix.comb)

    def boundary(self, h: torch.Tensor, y: torch.Tensor, done: HcMix, w: HcWeights, norm: RMSNorm,
                 collapse_pre: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, Mix]:
        if not self._chunks(h) or y.requires_grad:
            return super().boundary(h, y, done, w, norm, collapse_pre)
        h, x, mix = hc_boundary(h, y, done, w, collapse_pre)
        assert x is not None and mix is not None
        return h, norm(x), Mix(mix.pre, mix.post, mix.comb)

    def leave(self, h: torch.Tensor, y: torch.Tensor, done: HcMix) -> torch.Tensor:
        if not self._chunks(h) or y.requires_grad:
            return super().leave(h, y, done)
        return hc_boundary(h, y, done, None)[0]


class Mhc(BoundOp):
    """A block's (or the model's head's) mHC, bound once to one of the implementations above.

    `lagged` (V4.1): a sublayer collapses with the previous sublayer's pre; V4: with its own.
    Holds no parameters: the block passes its ``hc_{attn,ffn}_*`` (checkpoint names) as `HcWeights`.
    """

    def __init__(self, lagged: bool, hidden: int, rms_eps: float, hc_eps: float) -> None:
        self.lagged, self.hidden, self.rms_eps, self.hc_eps = lagged, hidden, rms_eps, hc_eps
        super().__init__()

    def select(self, choice: KernelChoice) -> Any:
        if not choice.batch_invariant:
            return ChunkedMhc()
        if not choice.native:
            return TorchMhc(invariant=True)
        return FusedMhc() if choice.fused_mhc and self.hidden >= 8 else NativeMhc()

    def enter(self, h: torch.Tensor, w: HcWeights, norm: RMSNorm, prev_pre: torch.Tensor | None
              ) -> tuple[torch.Tensor, Mix]:
        """(the sublayer's normed input x [T, D], its mixes) from streams h [T, hc, D]."""
        return self.impl.enter(h, w, norm, prev_pre if self.lagged else None)

    def boundary(self, h: torch.Tensor, y: torch.Tensor, done: HcMix, w: HcWeights, norm: RMSNorm
                 ) -> tuple[torch.Tensor, torch.Tensor, Mix]:
        """(streams after the finished sublayer's output y, the next sublayer's x, its mixes)."""
        return self.impl.boundary(h, y, done, w, norm, done.pre if self.lagged else None)

    def leave(self, h: torch.Tensor, y: torch.Tensor, done: HcMix) -> torch.Tensor:
        """The streams after the block's last sublayer output y."""
        return self.impl.leave(h, y, done)

    def head(self, h: torch.Tensor, pre: torch.Tensor | None, norm: RMSNorm, w: HcWeights | None) -> torch.Tensor:
        """The final collapse and RMSNorm: with `pre` (V4.1), or the head mixes `w` (V4)."""
        return self.impl.head(h, pre, norm, w, self.rms_eps, self.hc_eps)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("Mhc: call enter / boundary / leave / head")
