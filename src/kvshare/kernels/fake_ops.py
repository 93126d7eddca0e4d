"""Fake (meta) implementations of the ``torch.ops.kvshare`` ops: the shape, dtype and device of every
output from the arguments alone, so torch.compile / torch.export / FakeTensor tracing can run through
the native kernels without their data.

Invariant (tests/test_kernel_ops.py: `torch.library.opcheck` on every op): each function here returns
what the op's CPU kernel returns for valid arguments; ops that mutate an argument (``rope_``,
``sinkhorn_``, ``ring_store``) declare it in their schema
(``Tensor(a!)``). The ops whose pack set can be stale (``attn_in``, ``attn_out``, ``index_select``,
``moe_experts``) return an empty list then; a fake cannot know it and returns the full list (under
torch.compile a stale pack set is an error, not another path: the model rebuilds its packs after
every parameter registration, `pack_memo.per_generation`).
"""

from __future__ import annotations

import torch
from torch.library import register_fake

_REGISTERED = [False]
Tensor = torch.Tensor


def _like(x: Tensor, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype | None = None) -> Tensor:
    return x.new_empty(tuple(shape), dtype=dtype or x.dtype)


def register() -> None:
    """Register every fake once per process (the library must be loaded first)."""
    if _REGISTERED[0]:
        return
    _REGISTERED[0] = True

    @register_fake("kvshare::gemm")
    def _gemm(x, w, exps, fmt, n, k, kp, bk, isa, out_f32):  # noqa: ANN001, ANN202
        return _like(x, (x.shape[0], n), torch.float32 if out_f32 else x.dtype)

    @register_fake("kvshare::project_wide")
    def _project_wide(x, w, exps, n, k, isa, table, positions, offset):  # noqa: ANN001, ANN202
        return _like(x, (x.shape[0], n), torch.float32)

    @register_fake("kvshare::fake_quant_fp8")
    def _fake_quant_fp8(x, block):  # noqa: ANN001, ANN202
        return _like(x, x.shape)

    @register_fake("kvshare::rope")
    def _rope(x, c, s):  # noqa: ANN001, ANN202
        return _like(x, x.shape)

    @register_fake("kvshare::rope_")
    def _rope_(x, c, s):  # noqa: ANN001, ANN202
        return None

    @register_fake("kvshare::compress_pool")
    def _compress_pool(hist, valid, d, overlap, out_dtype):  # noqa: ANN001, ANN202
        return _like(hist, (hist.shape[0], d), out_dtype)

    @register_fake("kvshare::sparse_attention")
    def _sparse_attention(q, ka, va, kb, vb, sink, scale):  # noqa: ANN001, ANN202
        return _like(q, q.shape)

    @register_fake("kvshare::rms_norm")
    def _rms_norm(x, weight, eps, out_dtype):  # noqa: ANN001, ANN202
        return _like(x, x.shape, out_dtype)

    @register_fake("kvshare::swiglu")
    def _swiglu(gate, up, weight, limit):  # noqa: ANN001, ANN202
        return _like(gate, gate.shape)

    @register_fake("kvshare::moe_combine")
    def _moe_combine(out, sel, t, k):  # noqa: ANN001, ANN202
        return _like(out, (t, out.shape[1]))

    @register_fake("kvshare::moe_route")
    def _moe_route(logits, bias, k, func):  # noqa: ANN001, ANN202
        t = logits.shape[0]
        return _like(logits, (t, k)), _like(logits, (t, k), torch.int64)

    @register_fake("kvshare::moe_gate")
    def _moe_gate(x, w, exps, n, kdim, isa, bias, k, func, temp, normalize, factor, given):  # noqa: ANN001, ANN202
        t = x.shape[0]
        return _like(x, (t, k), torch.float32), _like(x, (t, k), torch.int64)

    @register_fake("kvshare::mhc_post")
    def _mhc_post(m, base, scale, hc, eps, iters):  # noqa: ANN001, ANN202
        t = m.shape[0]
        return _like(m, (t, hc)), _like(m, (t, hc)), _like(m, (t, hc, hc))

    @register_fake("kvshare::sinkhorn_")
    def _sinkhorn_(comb, eps, iters):  # noqa: ANN001, ANN202
        return None

    @register_fake("kvshare::mhc_collapse")
    def _mhc_collapse(h, pre):  # noqa: ANN001, ANN202
        return _like(h, (h.shape[0], h.shape[2]))

    @register_fake("kvshare::mhc_expand")
    def _mhc_expand(h, y, post, comb):  # noqa: ANN001, ANN202
        return _like(h, h.shape)

    @register_fake("kvshare::mhc_leave")
    def _mhc_leave(h, y, post, comb):  # noqa: ANN001, ANN202
        return _like(h, h.shape)

    def _entered(h: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        t, hc, d = h.shape
        return (_like(h, (t, d)), _like(h, (t, hc), torch.float32), _like(h, (t, hc), torch.float32),
                _like(h, (t, hc, hc), torch.float32))

    @register_fake("kvshare::mhc_enter")
    def _mhc_enter(h, fn, base, scale, collapse_pre, norm_w, norm_eps, rms_eps, hc_eps, iters, isa):  # noqa: ANN001, ANN202
        return _entered(h)

    @register_fake("kvshare::mhc_boundary")
    def _mhc_boundary(h, y, post, comb, fn, base, scale, collapse_pre, norm_w, norm_eps, rms_eps, hc_eps, iters,  # noqa: ANN001, ANN202
                      isa):
        return (_like(h, h.shape), *_entered(h))

    @register_fake("kvshare::mhc_head")
    def _mhc_head(h, fn, base, scale, pre, norm_w, norm_eps, rms_eps, hc_eps, isa):  # noqa: ANN001, ANN202
        return _like(h, (h.shape[0], h.shape[2]))

    @register_fake("kvshare::paged_attention")
    def _paged_attention(q, ring, step, meta, w, pool, tables, seq, picks, counts, ratio, block_size, sink,  # noqa: ANN001, ANN202
                         scale, codecs):
        return _like(q, q.shape)

    @register_fake("kvshare::index_topk")
    def _index_topk(q, w, keys, keys_bf16, tables, seq, counts, ratio, block_size, k):  # noqa: ANN001, ANN202
        return _like(seq, (q.shape[0], k), torch.int64)

    @register_fake("kvshare::index_select")
    def _index_select(qr, x, set_id, c, s, heads, scale, qr_block, isa, keys, keys_bf16, tables, seq, counts,  # noqa: ANN001, ANN202
                      ratio, block_size, k):
        return [_like(seq, (qr.shape[0], k), torch.int64)]

    @register_fake("kvshare::attn_in")
    def _attn_in(x, set_id, q_norm_w, kv_norm_w, eps, c, s, heads, head_norm, x_block, qr_block, isa):  # noqa: ANN001, ANN202
        t, rank, d = x.shape[0], q_norm_w.numel(), kv_norm_w.numel()  # the norms' widths are wq_a's and wkv's outputs
        return [_like(x, (t, rank)), _like(x, (t, heads, d)), _like(x, (t, d))]

    @register_fake("kvshare::attn_out")
    def _attn_out(o, set_id, c, s, u_block, out_dim, isa):  # noqa: ANN001, ANN202
        return [_like(o, (o.shape[0], out_dim))]

    @register_fake("kvshare::moe_experts")
    def _moe_experts(x, ids, weights, set_id, limit, x_block, h_block, isa):  # noqa: ANN001, ANN202
        return [_like(x, x.shape)]

    @register_fake("kvshare::fake_quant_fp4")
    def _fake_quant_fp4(x, block, ue8m0):  # noqa: ANN001, ANN202
        return _like(x, x.shape)

    @register_fake("kvshare::pack_rows")
    def _pack_rows(x, scheme, block, rope_dim, row_bytes):  # noqa: ANN001, ANN202
        return _like(x, (*x.shape[:-1], row_bytes), torch.uint8)

    @register_fake("kvshare::unpack_rows")
    def _unpack_rows(u8, scheme, block, dim, rope_dim, out_dtype):  # noqa: ANN001, ANN202
        return _like(u8, (*u8.shape[:-1], dim), out_dtype)

    @register_fake("kvshare::ring_store")
    def _ring_store(rings, values, tokens, slot, row):  # noqa: ANN001, ANN202
        return None
