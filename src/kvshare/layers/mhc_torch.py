"""Manifold-constrained hyper-connections, mHC (spec/model.md §7.1).

The residual is `hc` parallel streams h [T, hc, D]. For one sublayer with parameters
``fn`` [(2 + hc) * hc, hc * D], ``base`` [(2 + hc) * hc], ``scale`` [3]:

1. ``m = fn . (flat(h) * rsqrt(mean(flat(h)^2) + rms_norm_eps))`` in fp32;
2. ``pre = sigmoid(m[:hc] s0 + b[:hc]) + hc_eps``; ``post = 2 sigmoid(m[hc:2hc] s1 + b[hc:2hc])``;
   ``comb = softmax(m[2hc:] s2 + b[2hc:] as hc x hc, last axis) + hc_eps``;
3. Sinkhorn on comb: column-normalise, then (iters - 1) x (row, column); each division adds hc_eps;
4. collapse ``x = sum_j pre_j h_j``; expand ``h'_k = post_k y + sum_j comb[j, k] h_j``.

V4 collapses each sublayer with its own `pre` and ends with `hc_head` (sigmoid pre only).
V4.1 collapses with the previous sublayer's `pre` (one-hot [1, 0, ...] for the first) and ends
with the last sublayer's `pre`; the caller threads `pre` through.

These functions are the torch reference (autograd-capable) of `layers/mhc.py`'s implementations:
``invariant`` (a batch-invariant caller) sends the mix product through `ops.invariant.row_linear`
and the sigmoids through `ops.invariant.pointwise`; nothing else changes.
"""

from __future__ import annotations

import torch

from kvshare.layers.norm import rms_normalize
from kvshare.ops.invariant import matmul_t, pointwise
from kvshare.precision import wide

#: token counts up to which inference Sinkhorn runs through numpy (faster per call on tiny arrays;
#: torch's vectorised kernels win beyond this, measured 0.5 ms vs 0.7 ms at 256 tokens)
NUMPY_SINKHORN_MAX_T = 64


def hc_mix(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
           rms_eps: float, hc_eps: float, iters: int,
           hw: torch.Tensor | None = None, invariant: bool = False
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [T, hc], post [T, hc], comb [T, hc, hc]) in fp32 from streams h [T, hc, D].

    `hw`: ``wide(h)`` when the caller already has it (one conversion per sublayer, same bits).
    """
    t, hc, _ = h.shape
    hw = wide(h) if hw is None else hw
    m = matmul_t(rms_normalize(hw.reshape(t, -1), rms_eps), wide(fn), invariant)
    post, comb = hc_post_comb(m, base, scale, hc, hc_eps, iters, invariant)
    return hc_pre_of(m, base, scale, hc, hc_eps, invariant), post, comb


def hc_pre_of(m: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, hc_eps: float,
              invariant: bool = False) -> torch.Tensor:
    """Step 2's pre [T, hc] = sigmoid(m[:, :hc] s0 + b[:hc]) + hc_eps from the mixes m [T, (2 + hc) hc]."""
    return pointwise(torch.sigmoid, m[:, :hc] * wide(scale)[0] + wide(base)[:hc], invariant) + hc_eps


def hc_post_comb(m: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, hc_eps: float,
                 iters: int, invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 2-3's post [T, hc] and Sinkhorn-normalised comb [T, hc, hc] from the mixes m."""
    t = m.shape[0]
    b, s = wide(base), wide(scale)
    post = 2 * pointwise(torch.sigmoid, m[:, hc:2 * hc] * s[1] + b[hc:2 * hc], invariant)
    comb = torch.softmax((m[:, 2 * hc:] * s[2] + b[2 * hc:]).view(t, hc, hc), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    if comb.requires_grad:  # autograd: the out-of-place loop
        for _ in range(iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
        return post, comb
    if comb.device.type == "cpu" and t <= NUMPY_SINKHORN_MAX_T:
        return post, _sinkhorn_numpy(comb, hc_eps, iters)
    return post, _sinkhorn_token_minor(comb, hc_eps, iters)


def _sinkhorn_token_minor(comb: torch.Tensor, hc_eps: float, iters: int) -> torch.Tensor:
    """The (iters - 1) row/column divisions in place on a [hc, hc, T] copy of comb (inference).

    Same sums (hc terms in the same order), + eps and divisions as the spec's loop, so the same
    bits (tests/test_mhc_sinkhorn.py); with tokens as the contiguous axis every sum and division
    is a vector op over T instead of a reduction over hc = 4 adjacent values (6x faster at 2K tokens).
    """
    c = comb.permute(1, 2, 0).contiguous()  # [j, k, T]
    for _ in range(iters - 1):
        c.div_(c.sum(dim=1, keepdim=True).add_(hc_eps))  # rows: over k
        c.div_(c.sum(dim=0, keepdim=True).add_(hc_eps))  # columns: over j
    return c.permute(2, 0, 1).contiguous()


def _sinkhorn_numpy(comb: torch.Tensor, hc_eps: float, iters: int) -> torch.Tensor:
    """The (iters - 1) row/column divisions in place through a numpy view of comb (CPU only).

    Same operations in the same order as the torch loop (sum over the axis, + eps, divide), and
    bitwise the same result (tests/test_mhc_sinkhorn.py); numpy's per-call overhead on a
    [T, hc, hc] array is ~1 us against ~4 us for a torch op, and decode runs ~120 of them per mix.
    """
    a = comb.numpy()
    eps = a.dtype.type(hc_eps)
    for _ in range(iters - 1):
        s = a.sum(axis=-1, keepdims=True)
        s += eps
        a /= s
        s = a.sum(axis=-2, keepdims=True)
        s += eps
        a /= s
    return comb


def hc_collapse(h: torch.Tensor, pre: torch.Tensor, hw: torch.Tensor | None = None) -> torch.Tensor:
    """[T, D] = sum_j pre[:, j] h[:, j] (fp32 accumulate, cast to h's dtype); `hw` = wide(h) if known."""
    return (pre.unsqueeze(-1) * (wide(h) if hw is None else hw)).sum(dim=1).to(h.dtype)


def hc_expand(h: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
              hw: torch.Tensor | None = None) -> torch.Tensor:
    """[T, hc, D]: h'_k = post_k y + sum_j comb[j, k] h_j; `hw` = wide(h) if the caller has it."""
    mixed = torch.einsum("tjk,tjd->tkd", comb, wide(h) if hw is None else hw)
    return mixed.add_(post.unsqueeze(-1) * wide(y).unsqueeze(1)).to(h.dtype)  # + commutes: same bits


def hc_head_pre(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
                rms_eps: float, hc_eps: float, invariant: bool = False) -> torch.Tensor:
    """V4 final `pre` [T, hc] = sigmoid(fn . norm(flat h) * scale + base) + hc_eps."""
    m = matmul_t(rms_normalize(h.reshape(h.shape[0], -1), rms_eps), wide(fn), invariant)
    return pointwise(torch.sigmoid, m * wide(scale) + wide(base), invariant) + hc_eps


def identity_pre(t: int, hc: int, device: torch.device) -> torch.Tensor:
    """V4.1's `pre` before the first sublayer: one-hot on stream 0, [T, hc] fp32."""
    pre = torch.zeros(t, hc, device=device)
    pre[:, 0] = 1.0
    return pre
