"""The indexer's selection (spec/model.md §4.6, §4.6.1, §9), bound once: `IndexSelect`.

``IndexSelect(ctx, x, qr)`` -> [T, index_topk] ascending compressed-entry picks per token row (-1
padded): queries ``q = quant(RoPE(wq_b(qr)))`` [T, H_I, d_I], head weights
``w = wide(weights_proj(x)) * d_I^-0.5 * H_I^-0.5`` [T, H_I], scores against the index keys this
layer reads (causal mask ``j < (t + 1) // ratio``; candidate blocks published or used), then the
deterministic top-k. It holds no parameters: it reads its indexer's (``wq_b``, ``weights_proj``).

Implementations (picked by `select` from the `KernelChoice` and the indexer's plan):
* ``forward_torch`` (the batched mode): the scores of all rows in one product (`index_scores`);
* ``forward_invariant`` (batch-invariant, torch): one product shape per row (`row_index_scores`
  by length bucket, or `candidate_scores` whenever candidate blocks are used);
* ``forward_native`` (batch-invariant with the native attention kernels, d_I % 8 == 0, a layer
  that neither publishes nor uses candidate blocks, which need the scores): the scores and the
  top-k in one native call (`kernels.attn.index_topk`), the keys read in place from the pool where
  the cache backend offers them (`CacheBackend.pool_keys`), else gathered; summed in the kernel's
  own order (csrc/index.h), so a pick may differ from the torch path's only where two scores are
  within that rounding of each other;
* ``forward_fused`` (``forward_native`` with ``fused_attn_proj``): the query side too, in the same
  call (`kernels.attn_proj.index_select`: the GEMM, RoPE and FP8 rounding functions the torch path
  reaches, then the same top-k: the picks of ``forward_native``).
Per-call facts fall back inside them (the same picks as the implementation that then runs): a tie
log (it needs the scores), activations the kernels do not take (a model cast after binding,
autograd recording) -> ``forward_invariant``; a quantised index (Hadamard + FP4 of q stay torch),
a forward hook on wq_b / weights_proj, packs of another activation dtype -> ``forward_native``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from kvshare.kernels import attn_proj
from kvshare.kernels.attn import index_topk
from kvshare.kernels.pack_memo import per_generation
from kvshare.layers.attention import servable
from kvshare.layers.attn_proj import Owned, hook_dicts, hooked, pack_of
from kvshare.layers.choice import KernelChoice
from kvshare.layers.quant import fit_block
from kvshare.ops import block_scores, boundary_ties, candidate_block_mask, index_scores, invariant, select_topk
from kvshare.ops.index_scores import candidate_scores, row_index_scores
from kvshare.precision import wide

#: `model.indexer.Indexer`, which builds this layer: named, not imported (no import cycle)
Indexer = Any

if TYPE_CHECKING:
    from kvshare.step.context import StepContext


class IndexSelect(Owned):
    """The picks of an indexer (module doc)."""

    owner: "Indexer"

    def select(self, choice: KernelChoice) -> Callable[..., Any]:
        if not choice.batch_invariant:
            return self.forward_torch
        idx = self.owner
        plan = idx.plan
        if not choice.attention or idx.head_dim % 8 or plan.publishes_candidates or plan.uses_candidates:
            return self.forward_invariant
        return self.forward_fused if choice.fused_attn_proj else self.forward_native

    # ---- implementations ------------------------------------------------------------------------------
    def forward_torch(self, ctx: "StepContext", x: torch.Tensor, qr: torch.Tensor) -> torch.Tensor:
        q, w = self.queries(ctx, x, qr)
        return self.scored(ctx, q, w, rows_alone=False)

    def forward_invariant(self, ctx: "StepContext", x: torch.Tensor, qr: torch.Tensor) -> torch.Tensor:
        q, w = self.queries(ctx, x, qr)
        return self.scored(ctx, q, w, rows_alone=True)

    def forward_native(self, ctx: "StepContext", x: torch.Tensor, qr: torch.Tensor) -> torch.Tensor:
        if ctx.ties is not None or not servable(qr):
            return self.forward_invariant(ctx, x, qr)
        q, w = self.queries(ctx, x, qr)
        return self.native_scores(ctx, q, w) if servable(q) else self.scored(ctx, q, w, rows_alone=True)

    def forward_fused(self, ctx: "StepContext", x: torch.Tensor, qr: torch.Tensor) -> torch.Tensor:
        picks = self.fused(ctx, x, qr) if ctx.ties is None and servable(qr) else None
        return picks if picks is not None else self.forward_native(ctx, x, qr)

    # ---- the pieces ----------------------------------------------------------------------------------
    def queries(self, ctx: "StepContext", x: torch.Tensor, qr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [T, H_I, d_I] rotated and quantised, w [T, H_I] fp32 scaled head weights)."""
        idx = self.owner
        q = idx.wq_b(qr).view(x.shape[0], idx.n_heads, idx.head_dim)
        q = idx.quantizer.index(ctx.rope_compress.rotate(q, ctx.positions))
        w = wide(idx.weights_proj(x)) * (idx.head_dim**-0.5 * idx.n_heads**-0.5)
        return q, w

    def scored(self, ctx: "StepContext", q: torch.Tensor, w: torch.Tensor, rows_alone: bool) -> torch.Tensor:
        """The picks from the queries q [T, H, d] and head weights w [T, H] with torch ops;
        `rows_alone`: one product shape per row (the batch-invariant mode)."""
        idx = self.owner
        cfg, plan = idx.cfg, idx.plan
        pre = ctx.addr.prefix(idx.ratio)
        keys, _ = ctx.cache.gather_prefix("index_k", idx.layer, pre.n_rows, ctx.batch)
        compress_len = pre.compress_len
        cand_mask = ctx.state.candidates_of(plan.candidate_source, idx.layer) if plan.uses_candidates else None
        cap = cfg.candidate_topk_blocks * cfg.candidate_block_size
        if cand_mask is not None and (cap < keys.shape[1] or rows_alone):
            # only the rows inside the published candidate blocks: cost independent of the context
            # (and one fixed product shape per row, so a batch-invariant forward always takes it)
            scores = candidate_scores(q, w, keys, ctx.seq_index, cand_mask, cap)
        elif rows_alone:
            scores = row_index_scores(q, w, keys, ctx.seq_index, ctx.addr.length_buckets(idx.ratio, invariant.BUCKET))
        else:
            scores = index_scores(q, w, keys, ctx.seq_index, rows=ctx.addr.rows_layout())
        scores = scores.masked_fill(~pre.causal, float("-inf"))
        if plan.publishes_candidates:
            cand = cfg.candidate_topk_blocks
            mask = candidate_block_mask(scores, compress_len, cfg.candidate_block_size, cand)
            ctx.state.publish_candidates(idx.layer, mask)
            if ctx.ties is not None:
                self._log_ties(ctx, "candidates", boundary_ties(block_scores(scores, cfg.candidate_block_size), cand))
        if cand_mask is not None:
            scores = scores.masked_fill(~cand_mask, float("-inf"))
        if ctx.ties is not None:
            self._log_ties(ctx, "index", boundary_ties(scores, cfg.index_topk))
        return select_topk(scores, compress_len, cfg.index_topk)

    def native_scores(self, ctx: "StepContext", q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """`scored` in one native call (`kernels.attn.index_topk`; module doc)."""
        idx = self.owner
        pre, cache, k = ctx.addr.prefix(idx.ratio), ctx.cache, idx.cfg.index_topk
        rows = cache.pool_keys("index_k", idx.layer, q.dtype, ctx.batch)
        if rows is not None:
            return index_topk(q, w, rows.view, q.dtype, ctx.seq_index, pre.compress_len, k, rows.tables, rows.ratio,
                              rows.block_size)
        keys, _ = cache.gather_prefix("index_k", idx.layer, pre.n_rows, ctx.batch)
        return index_topk(q, w, keys, keys.dtype, ctx.seq_index, pre.compress_len, k)

    def fused(self, ctx: "StepContext", x: torch.Tensor, qr: torch.Tensor) -> torch.Tensor | None:
        """`native_scores` of the torch-projected queries, the projections in the same native call;
        None where that call does not serve (module doc)."""
        idx = self.owner
        if idx.quantizer.mode.index or qr.dim() != 2 or x.dtype != qr.dtype or torch.is_grad_enabled():
            return None
        pre, cache, k = ctx.addr.prefix(idx.ratio), ctx.cache, idx.cfg.index_topk
        c, s, _ = ctx.rope_compress.native_tables(ctx.positions)
        scale = idx.head_dim**-0.5 * idx.n_heads**-0.5
        for _ in range(2):  # a pack set found stale in C++ is rebuilt once
            f = fused_of(idx)
            if f is None or qr.dtype != f.packs.act_dtype or hooked(f.hooks):
                return None
            rows = cache.pool_keys("index_k", idx.layer, qr.dtype, ctx.batch)
            if rows is not None:
                picks = attn_proj.index_select(qr, x, f.packs, c, s, idx.n_heads, scale, f.qr_block, rows.view,
                                               qr.dtype, ctx.seq_index, pre.compress_len, k, rows.tables, rows.ratio,
                                               rows.block_size)
            else:
                keys, _ = cache.gather_prefix("index_k", idx.layer, pre.n_rows, ctx.batch)
                picks = attn_proj.index_select(qr, x, f.packs, c, s, idx.n_heads, scale, f.qr_block, keys, keys.dtype,
                                               ctx.seq_index, pre.compress_len, k)
            if picks is not None:
                return picks
            idx.__dict__.pop("_native_query", None)
        return None

    def _log_ties(self, ctx: "StepContext", kind: str, rows: torch.Tensor) -> None:
        n = int(rows.sum())
        if n and ctx.ties is not None:
            ctx.ties.append((self.owner.layer, kind, n))


# ---- the query pack set ------------------------------------------------------------------------------
@dataclass(eq=False)
class FusedQuery:
    """An indexer's pack set (wq_b, weights_proj) and what a call needs besides it."""

    packs: attn_proj.ProjPacks
    qr_block: int  # FP8 block of wq_b's input (0: none)
    hooks: tuple[dict, ...]


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

