"""The native decode-step kernels outside the GEMMs (csrc/decode.cpp), with the switch that selects them.

Each kernel computes every row from that row's inputs alone, in one call for all rows of a step
(no per-row Python, no host sync), so it keeps the batch-invariance contract of `ops/invariant.py`.
The model uses them inside a batch-invariant forward (`layers/mhc_torch.py`), where the torch code they
replace stays the reference and the fallback:

* `mhc_post`: mHC pre / post / comb from the mixes, the same bits as `hc_pre_of` + `hc_post_comb`:
  exp is SLEEF's vector expf (exported by libtorch_cpu), which torch's vectorised sigmoid and
  softmax call; sigmoid = 1 / (1 + exp(0 - z)); softmax = exp(z - max) * (1 / sequential sum);
  Sinkhorn sums in increasing index order from 0, + eps, divide.
* `rope`: the rotation of `layers/rope.py` (the same bits: each product rounded, then the sum,
  then the cast) from its per-position (C, S) tables, in one call instead of six ops.
* `compress_pool`: a compressor's softmax pooling over its history slots (`model/compressor.py`),
  the same bits as ``(torch.softmax(score, dim=1) * kv).sum(dim=1)``: SLEEF exp, the softmax's
  sequential sum and division, and the cascade torch's sum kernel uses over the slots.
* `sparse_attention`: attention with the per-head sink over a row's window keys and its gathered
  compressed rows, read in place (no concatenation). NOT the torch path's bits: torch's products
  are MKL batched GEMMs whose summation order is MKL's; this kernel sums each dot product in 8
  fma lanes (lanes added pairwise) and the weighted values in key order. The difference is
  bounded in tests/test_native_decode.py; batch invariance holds by construction (one row at a time).
* `rms_norm`: RMSNorm rows (`layers/norm.py`), the same bits: squares, torch's sum of a contiguous
  row (the AVX2 inner-sum kernel, which torch also runs under AVX-512: 8-lane vectors in 4 streams,
  cascaded), ``/ n``, ``+ eps``, ``1 / sqrt``, then ``x * r`` and ``* weight`` rounded one by one.
* `moe_route`: the gate's scores (sqrt(softplus) or sigmoid: SLEEF exp / log1p as torch's vector
  kernels; the sqrt is MKL's vmsSqrt, which torch.sqrt calls and which is not always correctly
  rounded) and the stable top-k of scores + bias (ties toward the lower expert id), the same bits
  and ids as `Gate.forward`'s torch code.
* `swiglu`, `moe_combine`: the MoE's clamped SwiGLU times the routing weight, and the per-token
  sum of its k routed slots plus the shared expert, the same bits as `model/moe.py` (SLEEF exp in
  silu = g / (1 + exp(-g)), every rounding to the model dtype where torch rounds, torch's cascade
  order over the k slots).
* `fake_quant_fp8`: the FP8 e4m3 quantise-dequantise of GEMM inputs (ue8m0 block scales), the same
  bits as `kvshare.quant.fake_quant_fp8` (c10's e4m3 and bf16 conversions, frexp for the scale), in
  one call instead of ~40 torch ops; used by `model/quantize.act_quant` in every mode.
* `mhc_collapse`, `mhc_expand`: the same bits as `hc_collapse` / `hc_expand` (collapse: products
  rounded, summed from 0 in stream order; expand: an fma chain over streams from 0, as torch's
  batched product does, plus the rounded ``post * y``).

* `moe_gate`: a MoE layer's gate in one call (`project_wide`, the division by the V4.1 temperature,
  `moe_route`, the normalisation by the weights' left-to-right sum, the routed scaling): the bits of
  `Gate.forward`'s torch code, which sums the k weights in the same order.
* `project_wide`: an fp32 projection of bf16 / fp32 rows (`kernels.linear` on an fp32 pack after the
  exact widening, the same bits) with an optional per-position table row added to some columns
  (a V4 compressor's APE; one rounded fp32 add per element, the bits of the torch add): one call
  where the torch code takes the widening, the product and four indexing / add ops.

Which of these a model runs is bound once per model build (`kvshare.layers`: each layer holds its
choice). `enabled()` says whether this machine runs them at all (the native library serves its CPU
and ``KVSHARE_NATIVE_DECODE`` is not off): the cache-row codecs (`kernels.rows`) and tests ask it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvshare.kernels.build import best_isa
from kvshare.layers import switches as env_switches
from kvshare.kernels.ops import ops

if TYPE_CHECKING:
    from kvshare.kernels.packed import Packed


def enabled() -> bool:
    """Whether this machine runs the native decode kernels: the library serves its CPU and
    ``KVSHARE_NATIVE_DECODE`` is not off (read through `layers.switches`, the one reader of the
    environment)."""
    return not env_switches.switched_off("native") and best_isa() != "torch"


def mhc_post(m: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, hc_eps: float,
             iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [T, hc], post [T, hc], comb [T, hc, hc]) fp32 from mixes m [T, (2 + hc) hc] (spec §7.1 steps 2-3)."""
    return ops.mhc_post(m.contiguous(), base.float().contiguous(), scale.float().contiguous(), hc, hc_eps,
                        iters)


def sinkhorn_(comb: torch.Tensor, hc_eps: float, iters: int) -> torch.Tensor:
    """The (iters - 1) Sinkhorn row / column divisions in place on comb [T, hc, hc] fp32 (contiguous)."""
    ops.sinkhorn_(comb, hc_eps, iters)
    return comb


def mhc_collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """[T, D] in h's dtype: sum_j pre[:, j] h[:, j] accumulated in fp32."""
    return ops.mhc_collapse(h.contiguous(), pre.float().contiguous())


def mhc_expand(h: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """[T, hc, D] in h's dtype: post_k y + sum_j comb[j, k] h_j in fp32."""
    return ops.mhc_expand(h.contiguous(), y.to(h.dtype).contiguous(), post.float().contiguous(),
                          comb.float().contiguous())


def rope(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, inplace: bool) -> torch.Tensor:
    """x [P, ..., D] (contiguous) with its last ``c.shape[1]`` dims rotated by the tables c, s [P, rd]
    fp32, contiguous (`RotaryEmbedding.pair_tables` builds them so); overwrites x when `inplace`."""
    if inplace:
        ops.rope_(x, c, s)
        return x
    return ops.rope(x, c, s)


def project_wide(x: torch.Tensor, packed: "Packed", table: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None, offset: int = 0) -> torch.Tensor:
    """[M, N] fp32 = ``wide(x) @ W^T`` for x [M, K] bf16 / fp32 and an fp32 `packed` weight (the bits of
    `kernels.linear` on ``wide(x)``); with `table` [R, C] fp32, row m then has ``table[positions[m] % R]``
    added to columns [offset, offset + C)."""
    if packed.fmt != "fp32":
        raise ValueError(f"kernels.project_wide: the weight must be an fp32 pack, got {packed.fmt}")
    return ops.project_wide(x, packed.data, packed.exps, packed.n, packed.k, best_isa(), table, positions, offset)


def moe_gate(x: torch.Tensor, packed: "Packed", bias: torch.Tensor | None, k: int, func: str, temp: float,
             normalize: bool, factor: float, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, ids [T, k] int64): `project_wide(x, packed)` logits (divided by `temp`
    unless 1), `moe_route`'s scores and picks (or, with `ids` given: V4's hash routing, the scores
    at those experts), each row's weights divided by their left-to-right sum + 1e-20
    (`normalize`), times `factor`: `model/moe.Gate.forward`'s torch code, the same bits."""
    if packed.fmt != "fp32":
        raise ValueError(f"kernels.moe_gate: the gate weight must be an fp32 pack, got {packed.fmt}")
    w, picks = ops.moe_gate(x, packed.data, packed.exps, packed.n, packed.k, best_isa(), bias, k, func,
                            temp, normalize, factor, ids)
    return w, picks


def compress_pool(hist: torch.Tensor, valid: torch.Tensor | None, d: int, overlap: bool,
                  dtype: torch.dtype) -> torch.Tensor:
    """[T, d] in `dtype`: softmax over the slots of the scores times the kv rows, from a compressor's
    history hist [T, S, 2 coff d] fp32 (see `model/compressor.py`); `valid` [T, S] masks slots."""
    return ops.compress_pool(hist.contiguous(), None if valid is None else valid.contiguous(), d, overlap, dtype)


def sparse_attention(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor, scale: float,
                     keys2: torch.Tensor | None = None, valid2: torch.Tensor | None = None) -> torch.Tensor:
    """[T, H, d] in q's dtype: `ops.sparse_attention` over keys [T, M, d] (mask valid [T, M]) followed by
    keys2 [T, M2, d] (mask valid2), without concatenating them (see module doc for the order)."""
    k2 = None if keys2 is None else keys2.to(q.dtype).contiguous()
    v2 = None if valid2 is None else valid2.contiguous()
    return ops.sparse_attention(q.contiguous(), keys.to(q.dtype).contiguous(), valid.contiguous(), k2, v2,
                                sink.float().contiguous(), scale)


def fake_quant_fp8(x: torch.Tensor, block: int) -> torch.Tensor | None:
    """`kvshare.quant.fake_quant_fp8(x, block, ue8m0=True)`'s bits in one call, or None where the
    kernel does not take x (not CPU, not bf16 / fp32, autograd, last dim not a multiple of block).
    The caller is bound to the native kernels (`KernelChoice.native`)."""
    if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu" or x.requires_grad or x.shape[-1] % block:
        return None
    return ops.fake_quant_fp8(x, block)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """RMSNorm over the last dim of x (contiguous, bf16 / fp32), times `weight` (fp32) if given, in `dtype`."""
    return ops.rms_norm(x, weight, eps, dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, limit: float) -> torch.Tensor:
    """[N, I] in gate's dtype: ``weight * silu(min(gate, limit)) * clamp(up, -limit, limit)`` as `model/moe.py`."""
    return ops.swiglu(gate, up, weight, limit)


def moe_combine(out: torch.Tensor, sel: torch.Tensor, t: int, k: int) -> torch.Tensor:
    """[T, D] in out's dtype: each token's k routed rows of `out` (row i holds slot ``sel[i]``) summed
    in fp32, plus its shared-expert row ``out[T k + t]``."""
    return ops.moe_combine(out, sel, t, k)


def moe_route(logits: torch.Tensor, bias: torch.Tensor | None, k: int, func: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32: the scores of the picks, ids [T, k] int64: descending, ties to the lower
    id) from gate logits [T, E] fp32; `func` "sqrtsoftplus" or "sigmoid"."""
    w, ids = ops.moe_route(logits, bias, k, func)
    return w, ids
