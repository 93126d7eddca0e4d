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
from kvshare.layers.index_select import IndexSelect
from kvshare.model.compressor import Compressor, Emitted
from kvshare.step.context import StepContext
from kvshare.layers.linear import QLinear, plain_linear
from kvshare.layers.norm import RMSNorm
from kvshare.model.quantize import KVQuantizer, QuantMode
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
        self.index_select = IndexSelect(self)  # queries, scores, top-k (bound: torch / native)

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
        candidate blocks still scores (its candidates need the scores). Otherwise the bound
        `IndexSelect` projects the queries, scores and picks."""
        if self.every_entry_fits(ctx.addr.prefix(self.ratio).width):
            return ctx.addr.causal_picks(self.ratio, self.cfg.index_topk)
        return self.index_select(ctx, x, qr)

    def every_entry_fits(self, width: int) -> bool:
        """Whether a step whose widest sequence has `width` compressed rows selects every causal
        entry without scoring (see `select`)."""
        return width <= self.cfg.index_topk and not (self.plan.publishes_candidates or self.plan.uses_candidates)
