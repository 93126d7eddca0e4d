"""The indexer's query side and top-k in one native call (`kernels.attn_proj.index_select`), where it serves.

`select` returns the picks `Indexer.native_select` would return, from the indexer's inputs (qr, x)
instead of its projected queries: q = RoPE(wq_b(qr)) (the FP8 rounding of qr first where the model
has it), w = wide(weights_proj(x)) * (d^-0.5 H^-0.5), then `index_topk` over the keys, read in place
(plain rows) or gathered. None where the torch composition must run: wherever `native_select` would
not (its conditions are the caller's), a quantised index (the Hadamard rotation and FP4 rounding
of q stay torch), a forward hook on wq_b or weights_proj, packs of another activation dtype.

Invariant: a result has the bits of `native_select` on the torch-projected queries (the kernels
compose the GEMM, RoPE and FP8 rounding functions the torch path reaches, then the same top-k).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvshare.kernels import attn_proj
from kvshare.kernels.pack_memo import per_generation
from kvshare.model.attention_native import hook_dicts, hooked, pack_of, serves
from kvshare.model.quantize import fit_block

if TYPE_CHECKING:
    from kvshare.model.context import StepContext
    from kvshare.model.indexer import Indexer


@dataclass(eq=False)
class FusedQuery:
    """An indexer's pack set (wq_b, weights_proj) and what a call needs besides it."""

    packs: attn_proj.ProjPacks
    qr_block: int  # FP8 block of wq_b's input (0: none)
    hooks: tuple[dict, ...]


def select(idx: "Indexer", ctx: "StepContext", x: torch.Tensor, qr: torch.Tensor) -> torch.Tensor | None:
    """[T, index_topk] picks for rows x [T, D] with query latents qr [T, q_lora], or None (module doc)."""
    if not serves(qr) or idx.quantizer.mode.index or qr.dim() != 2 or x.dtype != qr.dtype:
        return None
    pre, cache, k = ctx.addr.prefix(idx.ratio), ctx.cache, idx.cfg.index_topk
    c, s, _ = ctx.rope_compress.native_tables(ctx.positions)
    scale = idx.head_dim**-0.5 * idx.n_heads**-0.5
    for _ in range(2):  # a pack set found stale in C++ is rebuilt once
        f = fused_of(idx)
        if f is None or qr.dtype != f.packs.act_dtype or hooked(f.hooks):
            return None
        rows = cache.pool_keys("index_k", idx.layer, qr.dtype, ctx.batch) if hasattr(cache, "pool_keys") else None
        if rows is not None:
            picks = attn_proj.index_select(qr, x, f.packs, c, s, idx.n_heads, scale, f.qr_block, rows.view, qr.dtype,
                                           ctx.seq_index, pre.compress_len, k, rows.tables, rows.ratio, rows.block_size)
        else:
            keys, _ = cache.gather_prefix("index_k", idx.layer, pre.n_rows, ctx.batch)
            picks = attn_proj.index_select(qr, x, f.packs, c, s, idx.n_heads, scale, f.qr_block, keys, keys.dtype,
                                           ctx.seq_index, pre.compress_len, k)
        if picks is not None:
            return picks
        idx.__dict__.pop("_native_query", None)
    return None


def fused_of(idx: "Indexer") -> FusedQuery | None:
    """The indexer's `FusedQuery`, or None where the fused call does not serve it; built once per
    registration generation (`kernels.moe.generation`) and kept on the module, the negative answer too."""
    return per_generation(idx, "_native_query", lambda: _build(idx))


def _build(idx: "Indexer") -> FusedQuery | None:
    got = [pack_of(idx.wq_b), pack_of(idx.weights_proj)]
    if any(g is None for g in got):
        return None
    packs = attn_proj.pack_set([p for p, _ in got], [w for _, w in got])  # type: ignore[misc]
    if packs is None:
        return None
    wq_b = idx.wq_b
    return FusedQuery(packs, fit_block(wq_b.in_features, wq_b.block) if wq_b.mode.act else 0,
                      hook_dicts(idx.wq_b, idx.weights_proj))
