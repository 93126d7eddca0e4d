"""Lightning indexer (spec/model.md §4.6, §4.6.1, §9): index keys, scores, candidates, top-k.

* Index keys (owners only). V4.1: ``k_norm(wk(latent))`` from the compressor's pre-RoPE latent;
  V4: the indexer's own overlapping ratio-4 compressor of width `index_head_dim`. Then RoPE on
  the trailing rope dims at the entry position, then FP4 (V4: Hadamard first). Written as
  "index_k" rows by this layer; the cache backend puts them in every region its RegionMap assigns
  to this layer (one when sharing, every copy when not).
* Queries (every index source): ``wq_b(qr)`` -> [H_I, d_I], RoPE at t, FP4 (V4: Hadamard first).
  Head weights ``weights_proj(x) * d_I^-0.5 * H_I^-0.5``.
* Scores against rows [0, end // ratio) of the index keys this layer reads (the backend resolves
  the region: the STATIC index-K owner's when sharing, the corrected §9 behaviour, even on steps
  where the owner wrote nothing; the layer's own copy when not), causal mask ``j < (t + 1) // ratio``.
* The candidate source publishes its candidate mask from its unrestricted scores; later index
  sources of the same ratio mask their scores with it, and score only the rows inside it when
  those are fewer than all rows (`candidate_scores`); then deterministic top-k.

Checkpoint names: ``wq_b.weight``, ``weights_proj.weight``; V4.1 owners ``wk.weight``,
``k_norm.weight``; V4 ``compressor.{wkv,wgate,norm}.weight`` and ``compressor.ape``.
"""

from __future__ import annotations

import torch
from torch import nn

from kvshare.cache.layout import overlap_factor
from kvshare.config import ModelConfig
from kvshare.kernels import decode as native
from kvshare.kernels.attn import index_topk
from kvshare.model.compressor import Compressor, Emitted
from kvshare.model import indexer_native
from kvshare.model.context import StepContext
from kvshare.model.linear import QLinear, plain_linear
from kvshare.model.norm import RMSNorm
from kvshare.model.quantize import KVQuantizer, QuantMode
from kvshare.ops import block_scores, boundary_ties, candidate_block_mask, index_scores, invariant, select_topk
from kvshare.ops.index_scores import candidate_scores, row_index_scores
from kvshare.precision import wide
from kvshare.topology import LayerPlan, Topology


class Indexer(nn.Module):
    """The indexer of one index-source layer."""

    def __init__(self, cfg: ModelConfig, topo: Topology, plan: LayerPlan, mode: QuantMode,
                 quantizer: KVQuantizer) -> None:
        super().__init__()
        self.cfg, self.plan, self.quantizer = cfg, plan, quantizer
        self.layer, self.ratio = plan.layer, plan.ratio
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = QLinear(cfg.q_lora_rank, self.n_heads * self.head_dim, mode, cfg.act_quant_block)
        self.weights_proj = plain_linear(cfg.hidden_size, self.n_heads)
        self.owns_keys = plan.is_index_k_source
        if cfg.arch == "v41" and self.owns_keys:
            self.wk = plain_linear(cfg.head_dim, self.head_dim)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        if cfg.arch == "v4":
            self.compressor = Compressor(cfg.hidden_size, self.head_dim, plan.ratio, cfg.rms_norm_eps,
                                         overlap=overlap_factor(cfg.arch, plan.ratio) == 2, ape=True,
                                         name="indexer_compressor")

    # ---- index keys (owners) ---------------------------------------------------------------
    def write_keys(self, ctx: StepContext, x: torch.Tensor, latent: Emitted | None) -> None:
        """Compute this step's new index keys and store them (owners only; §3 step 2a)."""
        if not self.owns_keys:
            return
        v4 = self.cfg.arch == "v4"
        new = self.compressor(x, ctx, self.layer) if v4 else latent
        assert new is not None, "a V4.1 index-K owner is always a kv source"
        if new.count == 0:
            return
        keys = new.latent if v4 else self.k_norm(self.wk(new.latent))
        keys = ctx.rope_compress.rotate(keys, new.positions)
        keys = self.quantizer.index(keys)
        ctx.cache.write_rows("index_k", self.layer, new.seq, new.j, keys, ctx.batch)

    # ---- selection ---------------------------------------------------------------------------
    def select(self, ctx: StepContext, x: torch.Tensor, qr: torch.Tensor) -> torch.Tensor:
        """[T, index_topk] ascending compressed-entry picks per token row (-1 padded).

        When no sequence of the step has more than index_topk compressed rows (host ints), the
        top-k of every row is all of its causal entries whatever their scores (finite: relu'd
        dot products times finite weights), so nothing is scored; a layer that publishes or uses
        candidate blocks still scores (its candidates need the scores)."""
        pre = ctx.addr.prefix(self.ratio)
        if self.every_entry_fits(pre.width):
            return ctx.addr.causal_picks(self.ratio, self.cfg.index_topk)
        if self.native_serves(ctx, qr):  # the projections and the top-k in one call, the same picks
            picks = indexer_native.select(self, ctx, x, qr)
            if picks is not None:
                return picks
        t = x.shape[0]
        pos = ctx.positions
        q = self.wq_b(qr).view(t, self.n_heads, self.head_dim)
        q = self.quantizer.index(ctx.rope_compress.rotate(q, pos))
        w = wide(self.weights_proj(x)) * (self.head_dim**-0.5 * self.n_heads**-0.5)
        if self.native_serves(ctx, q):
            return self.native_select(ctx, q, w)
        return self.scored_select(ctx, q, w)

    def scored_select(self, ctx: StepContext, q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """`select` from the index queries q [T, H, d] and head weights w [T, H] with torch ops."""
        pre = ctx.addr.prefix(self.ratio)
        keys, _ = ctx.cache.gather_prefix("index_k", self.layer, pre.n_rows, ctx.batch)
        compress_len = pre.compress_len
        cand_mask = (ctx.state.candidates_of(self.plan.candidate_source, self.layer)
                     if self.plan.uses_candidates else None)
        cap = self.cfg.candidate_topk_blocks * self.cfg.candidate_block_size
        if cand_mask is not None and (cap < keys.shape[1] or invariant.is_on()):
            # only the rows inside the published candidate blocks: cost independent of the context
            # (and one fixed product shape per row, so a batch-invariant forward always takes it)
            scores = candidate_scores(q, w, keys, ctx.seq_index, cand_mask, cap)
        elif invariant.is_on():
            scores = row_index_scores(q, w, keys, ctx.seq_index, ctx.addr.length_buckets(self.ratio, invariant.BUCKET))
        else:
            scores = index_scores(q, w, keys, ctx.seq_index, rows=ctx.addr.rows_layout())
        scores = scores.masked_fill(~pre.causal, float("-inf"))
        if self.plan.publishes_candidates:
            cand = self.cfg.candidate_topk_blocks
            mask = candidate_block_mask(scores, compress_len, self.cfg.candidate_block_size, cand)
            ctx.state.publish_candidates(self.layer, mask)
            if ctx.ties is not None:
                blocks = block_scores(scores, self.cfg.candidate_block_size)
                self._log_ties(ctx, "candidates", boundary_ties(blocks, cand))
        if cand_mask is not None:
            scores = scores.masked_fill(~cand_mask, float("-inf"))
        if ctx.ties is not None:
            self._log_ties(ctx, "index", boundary_ties(scores, self.cfg.index_topk))
        return select_topk(scores, compress_len, self.cfg.index_topk)

    def native_serves(self, ctx: StepContext, q: torch.Tensor) -> bool:
        """Whether `native_select` takes this call: a batch-invariant forward with the native
        attention kernels on (the switch of the kernels whose sums are their own), bf16 / fp32
        queries `q` (or their latents), no candidate blocks and no tie log (both need the scores)."""
        return (invariant.is_on() and self.head_dim % 8 == 0 and ctx.ties is None and native.attention_enabled()
                and native.serves(q) and not (self.plan.publishes_candidates or self.plan.uses_candidates))

    def native_select(self, ctx: StepContext, q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """`scored_select` in one native call (`kernels.attn.index_topk`): the keys read in place
        from the pool where they are plain rows of q's dtype, else the gathered (decoded) rows; the
        scores summed in the kernel's own order (csrc/index.h), so a pick may differ from the torch
        path's only where two scores are within that rounding of each other."""
        pre, cache, k = ctx.addr.prefix(self.ratio), ctx.cache, self.cfg.index_topk
        rows = cache.pool_keys("index_k", self.layer, q.dtype, ctx.batch)
        if rows is not None:
            return index_topk(q, w, rows.view, q.dtype, ctx.seq_index, pre.compress_len, k, rows.tables, rows.ratio,
                              rows.block_size)
        keys, _ = cache.gather_prefix("index_k", self.layer, pre.n_rows, ctx.batch)
        return index_topk(q, w, keys, keys.dtype, ctx.seq_index, pre.compress_len, k)

    def every_entry_fits(self, width: int) -> bool:
        """Whether a step whose widest sequence has `width` compressed rows selects every causal
        entry without scoring (see `select`)."""
        return width <= self.cfg.index_topk and not (self.plan.publishes_candidates or self.plan.uses_candidates)

    def _log_ties(self, ctx: StepContext, kind: str, rows: torch.Tensor) -> None:
        n = int(rows.sum())
        if n and ctx.ties is not None:
            ctx.ties.append((self.layer, kind, n))
