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

`forward` is that one path; the three units with more than one implementation are layers bound
once per model build (`kvshare.layers`): ``project_in`` (`AttnIn`), ``attend`` (`PagedAttention`:
steps 4-5's reads and products), ``project_out`` (`AttnOut`). They hold no parameters.

V4 ratio-128 layers have no indexer and attend to every causal compressed entry.

Checkpoint names: ``wq_a``, ``q_norm``, ``wq_b``, ``wkv``, ``kv_norm``, ``wo_a``, ``wo_b``
(``.weight``), ``attn_sink``, ``compressor.*`` (kv sources), ``indexer.*`` (index sources).
"""

from __future__ import annotations

import torch
from torch import nn

from kvshare.cache.layout import overlap_factor
from kvshare.config import ModelConfig
from kvshare.layers.attention import PagedAttention
from kvshare.layers.attn_proj import AttnIn, AttnOut
from kvshare.model.compressor import Compressor, Emitted
from kvshare.step.context import StepContext
from kvshare.model.indexer import Indexer
from kvshare.layers.linear import QLinear, plain_linear
from kvshare.layers.norm import RMSNorm
from kvshare.model.quantize import KVQuantizer, QuantMode
from kvshare.topology import Topology



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
        self.attend = PagedAttention(layer, plan.ratio, cfg.sliding_window, d)  # -> o [T, H, d]
        self.project_out = AttnOut(self)  # [T, H, d] -> [T, D] (inverse RoPE, grouped wo_a, wo_b)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        pos, rope = ctx.positions, ctx.rope_for(self.ratio)
        qr, q, kv = self.project_in(x, pos, rope)
        kv = self.quantizer.window(kv)
        picks = self.compress_and_select(ctx, x, qr) if self.ratio > 0 else None
        o = self.attend(q, kv, picks, ctx, self.attn_sink)
        return self.project_out(o, pos, rope)

    def compress_and_select(self, ctx: StepContext, x: torch.Tensor, qr: torch.Tensor) -> torch.Tensor | None:
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
