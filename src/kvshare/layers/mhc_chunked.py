"""Inference mHC in token chunks: each sublayer boundary reads the streams once, while they sit in cache.

The maths is `layers/mhc_torch.py`'s (spec/model.md §7.1), op for op: per chunk of token rows the same
torch calls run on row slices (RMS statistic, ``normalised @ fn^T``, sigmoid ``pre``, the
``pre``-weighted stream sum, the ``comb``-mix einsum plus ``post * y``, the casts), and the
Sinkhorn runs once over all rows afterwards. Every one of those ops computes a row from that
row alone, so a chunked pass gives the unchunked results (tests/test_mhc_chunked.py checks
them bitwise in fp32, bf16 and float64 against the unchunked functions and the spec formulas).

Why: at prefill sizes the streams [T, hc, D] (fp32: 25 MB for 2,048 tokens at hc 4, D 768) do
not fit in cache, so the unchunked code streamed them through DRAM ~10 times per sublayer and
took about half of prefill (issue 19). A chunk of `CHUNK_BYTES` is read from DRAM once per
boundary and every later op of that boundary hits cache.

A boundary between two sublayers is one pass (`hc_boundary`): expand the finished sublayer's
output into the streams, round to the stream dtype, and compute the next sublayer's mix
statistics and collapse from those rounded streams.

Not for autograd: outputs are written into preallocated tensors. Training uses `layers/mhc_torch.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvshare.layers.mhc_torch import hc_post_comb, hc_pre_of
from kvshare.precision import wide

#: bytes of fp32 stream rows per chunk: ~1 MiB stays in a core's L2 with its temporaries in L3
CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class HcWeights:
    """One sublayer's mHC parameters: ``fn`` [(2 + hc) hc, hc D], ``base`` [(2 + hc) hc], ``scale`` [3]."""

    fn: torch.Tensor
    base: torch.Tensor
    scale: torch.Tensor
    rms_eps: float
    hc_eps: float
    iters: int


@dataclass
class HcMix:
    """A sublayer's mixes (fp32, float64 in a float64 model): pre/post [T, hc], comb [T, hc, hc]."""

    pre: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor


#: steps whose fp32 streams are at most this many chunks run unchunked: they stay in L3 between
#: ops, and the unchunked functions issue fewer ops (measured at hidden 768: unchunked 3.3 vs
#: 3.5 ms per block at 256 tokens, 6.9 vs 6.6 at 512, 17.0 vs 12.8 at 1,024, 37.5 vs 25.5 at 2,048)
MIN_CHUNKS = 4


def worth_chunking(t: int, hc: int, d: int) -> bool:
    """Whether a step of `t` token rows gains from the chunked passes (see `MIN_CHUNKS`)."""
    return t * hc * d * 4 > MIN_CHUNKS * CHUNK_BYTES


def chunk_rows(t: int, hc: int, d: int) -> int:
    """Rows per chunk: about `CHUNK_BYTES` of fp32 streams, evened out over the step's `t` rows."""
    step = max(1, CHUNK_BYTES // (4 * hc * d))
    n = -(-t // step)
    return -(-t // n) if n else 1


def hc_enter(h: torch.Tensor, w: HcWeights, collapse_pre: torch.Tensor | None
             ) -> tuple[torch.Tensor, HcMix]:
    """(x [T, D] in h's dtype, the mix) for the sublayer that reads streams h [T, hc, D].

    x collapses with `collapse_pre` (V4.1: the previous sublayer's pre) or, when None, with the
    pre computed here (V4).
    """
    _, x, mix = _pass(h, None, None, w, collapse_pre)
    assert x is not None and mix is not None
    return x, mix


def hc_boundary(h: torch.Tensor, y: torch.Tensor, done: HcMix, w: HcWeights | None,
                collapse_pre: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None, HcMix | None]:
    """Expand sublayer output y [T, D] into h with `done`'s post/comb; then, if `w` is given, enter
    the next sublayer from the new streams. Returns (new streams, x or None, mix or None)."""
    return _pass(h, y, done, w, collapse_pre)


def _pass(h: torch.Tensor, y: torch.Tensor | None, done: HcMix | None, w: HcWeights | None,
          collapse_pre: torch.Tensor | None
          ) -> tuple[torch.Tensor, torch.Tensor | None, HcMix | None]:
    t, hc, d = h.shape
    out = torch.empty_like(h) if y is not None else h
    x = m = pre = fn_t = None
    if w is not None:
        acc = torch.float64 if h.dtype == torch.float64 else torch.float32
        fn_t = wide(w.fn).t()
        m = torch.empty(t, w.fn.shape[0], dtype=acc, device=h.device)
        x = torch.empty(t, d, dtype=h.dtype, device=h.device)
        pre = collapse_pre if collapse_pre is not None else torch.empty(t, hc, dtype=acc, device=h.device)
    step = chunk_rows(t, hc, d)
    for a in range(0, t, step):
        b = min(t, a + step)
        hw = wide(h[a:b])
        if y is not None:
            assert done is not None
            mixed = torch.einsum("tjk,tjd->tkd", done.comb[a:b], hw)
            mixed.add_(done.post[a:b].unsqueeze(-1) * wide(y[a:b]).unsqueeze(1))  # + commutes: same bits
            out[a:b] = mixed
            hw = mixed if out.dtype == mixed.dtype else wide(out[a:b])  # the next mix sees rounded streams
        if w is not None:
            assert m is not None and x is not None and pre is not None and fn_t is not None
            flat = hw.reshape(b - a, hc * d)
            normed = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + w.rms_eps)
            torch.mm(normed, fn_t, out=m[a:b])
            if collapse_pre is None:
                pre[a:b] = hc_pre_of(m[a:b], w.base, w.scale, hc, w.hc_eps)
            x[a:b] = (pre[a:b].unsqueeze(-1) * hw).sum(dim=1)
    if w is None:
        return out, None, None
    assert m is not None and x is not None and pre is not None
    post, comb = hc_post_comb(m, w.base, w.scale, hc, w.hc_eps, w.iters)
    own_pre = hc_pre_of(m, w.base, w.scale, hc, w.hc_eps) if collapse_pre is not None else pre
    return out, x, HcMix(own_pre, post, comb)
