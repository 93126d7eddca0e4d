"""Attention's input and output projections in one native call each (csrc/attn_proj.cpp).

`attn_in(x, ...)` computes what `Attention.forward` computes before the attention, bitwise:
``qr = q_norm(wq_a(x))``, ``q = RoPE((V4: per-head RMSNorm of) wq_b(qr))`` and
``kv = RoPE(kv_norm(wkv(x)))``, with the FP8 rounding of the GEMM inputs where the model has it;
`attn_out(o, ...)` what `layers.attn_proj.AttnOut` computes: the inverse RoPE of o (o itself is left as it is), each
group's ``wo_a`` product, then ``wo_b``. The GEMMs are the C++ functions `kernels.linear` calls,
with its ISA (`best_isa`), padding and thread split; RMSNorm, RoPE and the FP8 rounding are
`kernels.decode`'s. So the bits are the torch path's in the batch-invariant mode, by construction.

**The pack set** (`ProjPacks`, `pack_set`; `layers/attn_proj.py` keeps it on the module): the
packs of wq_a, wq_b, wkv, each wo_a group and wo_b, taken from where the torch path takes them
(an FP8 / FP4 checkpoint weight's own `Packed`, else `ops.invariant.native_pack` of the dense
weight or group view), so nothing is packed twice. It is stale when a watched tensor changed its
address, dtype or in-place version (checked in C++ on every call against the registered set's
stamps, `kernels.pack_sets`: the call returns None); the
caller also rebuilds it after any parameter or submodule registration (`kernels.pack_memo.per_generation`).

Which implementation a model runs is bound once (`kvshare.layers.attn_proj`, `KernelChoice.fused_attn_proj`;
``KVSHARE_NATIVE_ATTN_PROJ=off`` reaches it through `kvshare.layers.switches`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvshare.kernels.build import best_isa, loaded
from kvshare.kernels.pack_sets import RegisteredSet
from kvshare.kernels.packed import FORMAT_ID, Packed
from kvshare.kernels.ops import ops


@dataclass(eq=False)
class ProjPacks:
    """The packed projections of one attention layer (module doc) and what they are valid for."""

    registered: RegisteredSet  # data, exps of linear l (wq_a, wq_b, wkv, wo_a groups 0..G-1, wo_b), meta
    # int64 [4 + G, 6] (fmt, n, k, kp, block, group_exps), the watched weights
    act_dtype: torch.dtype
    out_dim: int = 0  # the last linear's outputs (wo_b: `attn_out`'s width; the op checks it)


def pack_set(linears: list[Packed], watch: list[torch.Tensor]) -> ProjPacks | None:
    """The pack set from the packs in `ProjPacks.tensors`' order and the tensors whose change makes
    it stale; None without the native library or when the packs take different activation dtypes."""
    dtypes = {p.act_dtype for p in linears}
    if not loaded() or not linears or len(dtypes) != 1:
        return None
    tensors, meta = [], []
    for p in linears:
        tensors += [p.data, p.exps]
        meta.append([FORMAT_ID[p.fmt], p.n, p.k, p.kp, p.block, int(p.fmt == "fp8" and p.exps.dim() == 2)])
    return ProjPacks(RegisteredSet(tensors, torch.tensor(meta, dtype=torch.int64), watch), dtypes.pop(), linears[-1].n)


def attn_in(x: torch.Tensor, packs: ProjPacks, q_norm: torch.Tensor, kv_norm: torch.Tensor, eps: float,
            c: torch.Tensor, s: torch.Tensor, heads: int, head_norm: bool, x_block: int, qr_block: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(qr [T, q_lora], q [T, H, d], kv [T, d]) in x's dtype for x [T, D] (`packs.act_dtype`):
    q_norm / kv_norm the fp32 RMSNorm weights, c, s [T, rd] fp32 the positions' RoPE tables,
    `head_norm` V4's per-head RMSNorm of q, `x_block` / `qr_block` the FP8 blocks of the wq_a / wkv
    and wq_b inputs (0: none). None when a watched weight changed (rebuild the packs, call again)."""
    out = ops.attn_in(x, packs.registered.id, q_norm, kv_norm, eps, c, s, heads, head_norm, x_block,
                      qr_block, best_isa())
    return (out[0], out[1], out[2]) if out else None


def attn_out(o: torch.Tensor, packs: ProjPacks, c: torch.Tensor, s_neg: torch.Tensor, u_block: int
             ) -> torch.Tensor | None:
    """[T, D] in o's dtype from the attention output o [T, H, d] (contiguous, not modified; rotated back
    by the tables c, s_neg [T, rd] fp32: the inverse rotation's), `u_block` the FP8 block of wo_b's
    input (0: none). None when a watched weight changed."""
    out = ops.attn_out(o, packs.registered.id, c, s_neg, u_block, packs.out_dim, best_isa())
    return out[0] if out else None


def index_select(qr: torch.Tensor, x: torch.Tensor, packs: ProjPacks, c: torch.Tensor, s: torch.Tensor, heads: int,
                 scale: float, qr_block: int, keys: torch.Tensor, keys_dtype: torch.dtype, seq: torch.Tensor,
                 counts: torch.Tensor, k: int, tables: torch.Tensor | None = None, ratio: int = 1,
                 block_size: int = 1) -> torch.Tensor | None:
    """The indexer's picks [T, k] (`kernels.attn.index_topk`'s) from its inputs in one call: q = RoPE(wq_b(
    [FP8] qr)) by the tables c, s [T, rd], w = fp32(weights_proj(x)) * scale, for the pack set (wq_b,
    weights_proj); keys as `index_topk` takes them. None when a watched weight changed."""
    out = ops.index_select(qr, x, packs.registered.id, c, s, heads, scale, qr_block, best_isa(), keys,
                           keys_dtype == torch.bfloat16, tables, seq, counts, ratio, block_size, k)
    return out[0] if out else None
