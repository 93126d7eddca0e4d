"""One layer's attention (spec/model.md §3, §4.3–4.7): queries, window, compressed branch, output.

Order within a layer with ratio > 0 (§3), so that a query can select an entry created in the same
step:

1. kv source: compress this step's tokens -> pre-RoPE latents of completed groups;
2. index source: (owner) index keys from those latents are written; score against the static
   owner's index keys; candidates; top-k; publish. Other layers take their index source's top-k;
3. kv source: RoPE + quantise the latents and write them (``write_rows("kv", layer)``: the cache
   backend stores them in every region its RegionMap assigns to this layer);
4. read the selected compressed rows of this layer (``gather_rows("kv", layer)``; the backend
   resolves the region: the kv source's when sharing, the layer's own copy when not), after the write;
5. attend over the window (own ring, depth W) plus the selected rows, with the per-head sink;
   inverse RoPE at the query position; grouped ``wo_a`` then ``wo_b``.

V4 ratio-128 layers have no indexer and attend to every causal compressed entry.

Checkpoint names: ``wq_a``, ``q_norm``, ``wq_b``, ``wkv``, ``kv_norm``, ``wo_a``, ``wo_b``
(``.weight``), ``attn_sink``, ``compressor.*`` (kv sources), ``indexer.*`` (index sources).
"""

from __future__ import annotations

import torch
from torch import nn

from kvshare.cache.layout import overlap_factor
from kvshare.config import ModelConfig
from kvshare.kernels import decode as native
from kvshare.kernels.attn import paged_attention
from kvshare.layers.attn_proj import AttnIn, AttnOut
from kvshare.model.compressor import Compressor, Emitted
from kvshare.model.context import StepContext
from kvshare.model.indexer import Indexer
from kvshare.model.linear import QLinear, plain_linear
from kvshare.model.norm import RMSNorm
from kvshare.model.quantize import KVQuantizer, QuantMode
from kvshare.ops import invariant, sparse_attention
from kvshare.ops.prefix_attention import picks_to_mask, prefix_attention, window_keys
from kvshare.topology import Topology


PER_SEQ_FACTOR = 2  # read a sequence's compressed rows whole while there are at most 2k of them


class Attention(nn.Module):
    """Attention of backbone layer `layer`, wired by its LayerPlan."""

    def __init__(self, cfg: ModelConfig, topo: Topology, layer: int, mode: QuantMode,
                 quantizer: KVQuantizer) -> None:
        super().__init__()
        plan = topo[layer]
        self.cfg, self.topo, self.plan, self.quantizer = cfg, topo, plan, quantizer
        self.layer, self.ratio = layer, plan.ratio
        d, h, blk = cfg.head_dim, cfg.num_attention_heads, cfg.act_quant_block
        self.n_heads, self.head_dim = h, d
        self.n_groups = cfg.o_groups  # heads and groups held here (tensor parallelism shards both)
        self.wq_a = QLinear(cfg.hidden_size, cfg.q_lora_rank, mode, blk)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = QLinear(cfg.q_lora_rank, h * d, mode, blk)
        self.wkv = QLinear(cfg.hidden_size, d, mode, blk)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.wo_a = plain_linear(h * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)
        self.wo_b = QLinear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, mode, blk)
        self.attn_sink = nn.Parameter(torch.zeros(h))
        if plan.is_kv_source:
            self.compressor = Compressor(cfg.hidden_size, d, plan.ratio, cfg.rms_norm_eps,
                                         overlap=overlap_factor(cfg.arch, plan.ratio) == 2, ape=cfg.arch == "v4")
        if plan.is_index_source:
            self.indexer = Indexer(cfg, topo, plan, mode, quantizer)
        self.project_in = AttnIn(self)  # [T, D] -> qr, q, kv (bound: torch composition / one native call)
        self.project_out = AttnOut(self)  # [T, H, d] -> [T, D] (inverse RoPE, grouped wo_a, wo_b)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        pos = ctx.positions
        rope = ctx.rope_for(self.ratio)
        qr, q, kv = self.project_in(x, pos, rope)
        kv = self.quantizer.window(kv)
        scale, batch, addr = self.head_dim**-0.5, ctx.batch, ctx.addr
        if invariant.is_on():
            return self.project_out(self._attend_rows(ctx, x, qr, q, kv, scale), pos, rope)
        comp, comp_valid, per_seq = self._compressed(ctx, x, qr) if self.ratio > 0 else (None, None, True)
        if per_seq:
            # window keys per sequence: the W-1 stored rows before the chunk (the window of each
            # sequence's first row, minus that row), then the chunk's own rows
            depth = self.cfg.sliding_window
            hist, _ = ctx.cache.history("window", self.layer, kv, depth, batch, addr.first)
            keys = window_keys(hist[:, :depth - 1], kv, ctx.seq_index, addr.rank, addr.max_len)
            o = prefix_attention(q, keys, batch.starts, comp, comp_valid, ctx.seq_index, addr.rank,
                                 self.attn_sink, scale, rows=addr.rows_layout())
        else:
            win, win_valid = ctx.cache.history("window", self.layer, kv, self.cfg.sliding_window, batch)
            win = torch.cat([win, comp.to(win.dtype)], dim=1)
            win_valid = torch.cat([win_valid, comp_valid], dim=1)
            o = sparse_attention(q, win, win_valid, self.attn_sink, scale)
        return self.project_out(o, pos, rope)

    def _attend_rows(self, ctx: StepContext, x: torch.Tensor, qr: torch.Tensor, q: torch.Tensor,
                     kv: torch.Tensor, scale: float) -> torch.Tensor:
        """Batch-invariant attention [T, H, d]: every query row attends its own gathered keys with a
        product shape set by the row alone (ops/invariant.py): its W window rows, then its k top-k
        picks (top-k layers) or its causal compressed entries padded to a length bucket (V4 HCA;
        rows grouped by bucket). Same maths as `forward`'s paths; only the summation shapes differ.
        On top-k layers a row whose bucket is below k reads only min(bucket, k) pick columns (the
        rest are -1 for it): prefill at short contexts gathers its few compressed rows, not k."""
        batch = ctx.batch
        o = self._attend_in_place(ctx, x, qr, q, kv, scale)
        if o is not None:
            return o
        win, win_valid = ctx.cache.history("window", self.layer, kv, self.cfg.sliding_window, batch)
        if self.ratio == 0:
            return self._attend(q, win, win_valid, scale)
        topk = self._compress_and_select(ctx, x, qr)
        seq = ctx.seq_index
        buckets = ctx.addr.length_buckets(self.ratio, invariant.BUCKET)  # a few per step, host ints
        if topk is not None:
            k = topk.shape[1]
            if buckets[0][0] >= k:  # every row may hold k picks: one product shape for all
                return self._attend_picks(ctx, q, win, win_valid, seq, topk, scale)
            out = q.new_empty(q.shape)
            for b, rows_b in buckets:
                # a row picks at most its causal count (pos + 1) // ratio <= b entries, listed first
                # (ops/topk.py): columns past min(b, k) are -1 padding for every row of the bucket
                out[rows_b] = self._attend_picks(ctx, q[rows_b], win[rows_b], win_valid[rows_b], seq[rows_b],
                                                 topk[rows_b, :min(b, k)], scale)
            return out
        n_causal = ctx.addr.prefix(self.ratio).compress_len
        out = q.new_empty(q.shape)
        for b, rows_b in buckets:
            j = torch.arange(b, device=q.device).unsqueeze(0).expand(rows_b.numel(), -1)
            j = j.masked_fill(j >= n_causal[rows_b].unsqueeze(1), -1)
            out[rows_b] = self._attend_picks(ctx, q[rows_b], win[rows_b], win_valid[rows_b], seq[rows_b], j, scale)
        return out

    def _attend_in_place(self, ctx: StepContext, x: torch.Tensor, qr: torch.Tensor, q: torch.Tensor,
                         kv: torch.Tensor, scale: float) -> torch.Tensor | None:
        """`_attend_rows` with every key read where the cache stores it (`kernels/attn.py`: the window
        ring and this step's rows, the pool's compressed rows through the block table), all rows in
        one call; the same keys in the same order as the gathers, so the bits of the native kernel
        over gathered rows. None (nothing done, nothing deferred) where it does not serve: the native
        attention off, no in-place reads in this backend (the dense cache), or quantised rows."""
        cache = ctx.cache
        if (q.dtype != kv.dtype or q.shape[-1] % 8
                or not native.attention_enabled() or not native.serves(q, kv)):
            return None
        rows = cache.pool_keys("kv", self.layer, q.dtype, ctx.batch) if self.ratio > 0 else None
        if self.ratio > 0 and rows is None:
            return None
        win = cache.window_keys("window", self.layer, kv, self.cfg.sliding_window, ctx.batch)
        if win is None:
            return None
        if rows is None:
            return paged_attention(q, win.ring, win.step, win.meta, win.depth, self.attn_sink, scale)
        topk = self._compress_and_select(ctx, x, qr)
        pre = ctx.addr.prefix(self.ratio)
        counts = pre.compress_len if topk is None else None  # V4 HCA: every causal entry
        if topk is not None and topk.shape[1] > pre.width:
            # a row picks at most its causal count <= width entries, listed first: the columns past
            # the width are -1 for every row (they add nothing; the kernel need not visit them)
            topk = topk[:, :pre.width]
        return paged_attention(q, win.ring, win.step, win.meta, win.depth, self.attn_sink, scale, rows.view,
                               rows.tables, ctx.seq_index, topk, counts, rows.ratio, rows.block_size)

    def _attend_picks(self, ctx: StepContext, q: torch.Tensor, win: torch.Tensor, win_valid: torch.Tensor,
                      seq: torch.Tensor, picks: torch.Tensor, scale: float) -> torch.Tensor:
        """`sparse_attention` of query rows q [T, H, d] over their window keys, then their picked
        compressed rows (picks [T, m], -1 = none) gathered from the cache."""
        rows = ctx.cache.gather_rows("kv", self.layer, seq.unsqueeze(1).expand_as(picks), picks, ctx.batch)
        return self._attend(q, win, win_valid, scale, rows, picks >= 0)

    def _attend(self, q: torch.Tensor, win: torch.Tensor, win_valid: torch.Tensor, scale: float,
                rows: torch.Tensor | None = None, rows_valid: torch.Tensor | None = None) -> torch.Tensor:
        """`sparse_attention` of each query row over its window keys, then its compressed `rows`
        (if any). The native kernel (`kernels.decode.sparse_attention`: no concatenation, its own
        summation order, bounded against this torch code in tests) where it serves the tensors."""
        if q.dtype == win.dtype and q.shape[-1] % 8 == 0 and native.attention_enabled() and native.serves(q, win):
            return native.sparse_attention(q, win, win_valid, self.attn_sink, scale, rows, rows_valid)
        if rows is not None:
            win = torch.cat([win, rows.to(win.dtype)], dim=1)
            win_valid = torch.cat([win_valid, rows_valid], dim=1)
        return sparse_attention(q, win, win_valid, self.attn_sink, scale)

    def _compress_and_select(self, ctx: StepContext, x: torch.Tensor, qr: torch.Tensor) -> torch.Tensor | None:
        """Steps 1-3 of the module doc: compress, index (publish or take the top-k), write the new
        compressed rows. Returns the top-k picks [T, k] (-1 padded), or None (V4 HCA layers)."""
        plan, batch = self.plan, ctx.batch
        new: Emitted | None = self.compressor(x, ctx, self.layer) if plan.is_kv_source else None

        topk = None
        if plan.is_index_source:
            self.indexer.write_keys(ctx, x, new)
            topk = self.indexer.select(ctx, x, qr)
            ctx.state.publish_topk(self.layer, topk)
        elif plan.index_source is not None:
            topk = ctx.state.topk_of(plan.index_source, self.layer)

        if new is not None and new.count:
            lat = ctx.rope_compress.rotate(new.latent, new.positions)
            lat = self.quantizer.compressed(lat)
            ctx.cache.write_rows("kv", self.layer, new.seq, new.j, lat, batch)
        return topk

    def _compressed(self, ctx: StepContext, x: torch.Tensor, qr: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Steps 1-4 of the module doc: (rows, mask, per_seq).

        per_seq False: rows [T, M, d] gathered per query row (the top-k picks), mask [T, M].
        per_seq True: rows [N, L, d], every compressed row of each sequence, read once, with
        mask [T, L] of the rows each query attends: V4 HCA layers (every causal entry), and
        top-k layers when L <= PER_SEQ_FACTOR * index_topk, where one dense pass over a
        sequence's rows is cheaper than copying k rows per query (prefill, short contexts).
        """
        batch = ctx.batch
        topk = self._compress_and_select(ctx, x, qr)
        pre = ctx.addr.prefix(self.ratio)  # host width: the choice below reads nothing from the device
        if topk is not None and pre.width > PER_SEQ_FACTOR * topk.shape[1]:
            return ctx.cache.gather_rows("kv", self.layer, ctx.seq_index, topk, batch), topk >= 0, False
        rows, valid = ctx.cache.gather_prefix("kv", self.layer, pre.n_rows, batch)
        if topk is not None:
            return rows, picks_to_mask(topk, rows.shape[1]), True
        # V4 HCA: every causal compressed entry.
        return rows, valid[ctx.seq_index] & pre.causal, True
