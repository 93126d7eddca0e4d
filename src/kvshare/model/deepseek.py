"""The DeepSeek-V4 / V4.1 backbone: embedding, blocks (mHC + attention + MoE), final collapse, head.

``Transformer(cfg, topo=None, quant=True)``; ``forward(input_ids [T], batch, cache) -> logits [R, V]``
where R = ``batch.logit_rows`` (or all T rows). One implementation serves the dense reference
cache and the paged engine: the model owns the math, the `CacheBackend` only stores and gathers.
Cross-layer hand-offs live in a fresh `StepState` per forward.

Parameter names equal DeepSeek's released checkpoint names (`embed.weight`, `layers.{L}.attn.*`,
`layers.{L}.ffn.*`, `layers.{L}.{attn_norm,ffn_norm}.weight`, `layers.{L}.hc_{attn,ffn}_{fn,base,scale}`,
`norm.weight`, `head.weight`, V4 `hc_head_{fn,base,scale}`, V4.1 `layers.{L}.engram.{wkv.weight,
q_weight,k_weight}`). Draft (MTP / DSpark) layers are not built here (`model/dspark.py` attaches
DSpark stages as ``mtp``; a target layer's input stream, after its Engram, is recorded into
``StepState.taps``).

Engram (V4.1, `model/engram.py`): the row ids of every Engram layer are hashed once per forward
(before the embedding) from the step's tokens and ``batch.prev_tokens``; block L adds its Engram
output to the streams before computing its mixes. The hash needs the model's tokenizer (its
compressed token map); without one the byte-level tokenizer of the vocabulary is used, and a
compressed vocabulary that does not match the config raises ConfigError.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvshare.config import ModelConfig
from kvshare.kernels import decode as native
from kvshare.kernels import mhc as fused_mhc
from kvshare.kernels.packed import Packed
from kvshare.layers import KernelChoice, bind_model
from kvshare.layers import switches
from kvshare.model.attention import Attention
from kvshare.model.context import StepContext
from kvshare.model.engram import Engram, engram_hasher, lookback_ids
from kvshare.model.engram_table import EngramTable
from kvshare.model.linear import plain_linear
from kvshare.model.mhc import hc_collapse, hc_expand, hc_head_pre, hc_mix, identity_pre
from kvshare.model.mhc_chunked import HcWeights, hc_boundary, hc_enter, worth_chunking
from kvshare.model.moe import MoE
from kvshare.model.norm import RMSNorm
from kvshare.model.quantize import KVQuantizer, QuantMode
from kvshare.model.rope import RotaryEmbedding
from kvshare.ops import invariant
from kvshare.ops.invariant import native_pack
from kvshare.precision import wide
from kvshare.runtime import CacheBackend, StepBatch, StepState
from kvshare.topology import Topology


def _fused_mhc_serves(cfg: ModelConfig) -> bool:
    """Whether a forward that runs the native mHC kernels makes them as fused calls (`kernels/mhc.py`):
    switched on, no autograd, rows the native RMSNorm takes (hidden >= 8)."""
    return fused_mhc.enabled() and not torch.is_grad_enabled() and cfg.hidden_size >= 8


def _fp32_pack(fn: torch.Tensor) -> Packed | None:
    """The fp32 pack `row_linear` multiplies by in the unfused path, ``native_pack(wide(fn))``: an fp32
    parameter's own pack (without the `wide` call), a bf16 one's widened copy."""
    return native_pack(fn if fn.dtype == torch.float32 else wide(fn))


class Block(nn.Module):
    """One backbone layer: mHC-wrapped attention sublayer, then mHC-wrapped MoE sublayer."""

    def __init__(self, cfg: ModelConfig, topo: Topology, layer: int, mode: QuantMode,
                 quantizer: KVQuantizer) -> None:
        super().__init__()
        self.cfg = cfg
        n_mix, width = (2 + cfg.hc_mult) * cfg.hc_mult, cfg.hc_mult * cfg.hidden_size
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, topo, layer, mode, quantizer)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn = MoE(cfg, layer, mode)
        for sub in ("attn", "ffn"):
            setattr(self, f"hc_{sub}_fn", nn.Parameter(torch.zeros(n_mix, width)))
            setattr(self, f"hc_{sub}_base", nn.Parameter(torch.zeros(n_mix)))
            setattr(self, f"hc_{sub}_scale", nn.Parameter(torch.ones(3)))
        self.engram = Engram(cfg, layer, mode) if layer in cfg.engram_layer_ids else None

    def _hc_weights(self, sub: str) -> HcWeights:
        """Sublayer `sub`'s ("attn" / "ffn") mHC parameters and constants."""
        cfg = self.cfg
        return HcWeights(getattr(self, f"hc_{sub}_fn"), getattr(self, f"hc_{sub}_base"),
                         getattr(self, f"hc_{sub}_scale"), cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)

    def _mix(self, sub: str, h: torch.Tensor, hw: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        w = self._hc_weights(sub)
        return hc_mix(h, w.fn, w.base, w.scale, rms_eps=w.rms_eps, hc_eps=w.hc_eps, iters=w.iters, hw=hw)

    def forward(self, h: torch.Tensor, pre_prev: torch.Tensor | None,
                ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(streams after the block, the `pre` the next sublayer collapses with in V4.1)."""
        lagged = self.cfg.arch == "v41"
        if self.engram is not None:  # pre_prev stays: it was computed from the pre-Engram stream (§7.1)
            assert ctx.engram_ids is not None
            h = self.engram(h, ctx.engram_ids[:, self.engram.index])
        taps = ctx.state.taps if ctx.state is not None else None
        if taps is not None and self.attn.layer in taps:  # DSpark: the stream entering this layer (after
            taps[self.attn.layer] = h.mean(dim=1)  # its Engram, spec engram_dspark.md §4 Q1)
        if torch.is_grad_enabled() or invariant.is_on() or not worth_chunking(*h.shape):
            return self._forward_unchunked(h, pre_prev, ctx, lagged)  # training; small steps (decode)
        return self._forward_chunked(h, pre_prev, ctx, lagged)

    def _forward_unchunked(self, h: torch.Tensor, pre_prev: torch.Tensor | None, ctx: StepContext,
                           lagged: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`'s sublayers with `model/mhc.py`'s whole-step functions (autograd-capable)."""
        # the fp32 streams, converted once per sublayer for the mix, collapse and expand; the native
        # kernels read the streams in their own dtype (the same values), so they need no copy
        native_mhc = invariant.is_on() and native.serves(h)
        if native_mhc and _fused_mhc_serves(self.cfg):
            return self._forward_fused(h, pre_prev, ctx, lagged)
        hw = None if native_mhc else wide(h)
        pre, post, comb = self._mix("attn", h, hw)
        x = hc_collapse(h, pre_prev if lagged else pre, hw)
        h = hc_expand(h, self.attn(self.attn_norm(x), ctx), post, comb, hw)
        pre_attn, hw = pre, None if native_mhc else wide(h)
        pre, post, comb = self._mix("ffn", h, hw)
        x = hc_collapse(h, pre_attn if lagged else pre, hw)
        h = hc_expand(h, self.ffn(self.ffn_norm(x), ctx.input_ids), post, comb, hw)
        return h, pre

    def _fused_mix(self, sub: str) -> tuple[Packed | None, torch.Tensor, torch.Tensor]:
        """Sublayer `sub`'s mix for `kernels/mhc.py`: (fn's fp32 pack, base, scale)."""
        w = self._hc_weights(sub)
        return _fp32_pack(w.fn), w.base, w.scale

    def _forward_fused(self, h: torch.Tensor, pre_prev: torch.Tensor | None, ctx: StepContext,
                       lagged: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`_forward_unchunked`'s native calls fused per sublayer boundary (`kernels/mhc.py`: the same
        calls in the same order, so the same bits): enter(attn), attention, boundary(ffn), MoE, leave (expand)."""
        cfg = self.cfg
        consts = (cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)
        an, fnorm = self.attn_norm, self.ffn_norm
        x, pre, post, comb = fused_mhc.enter(h, *self._fused_mix("attn"), pre_prev if lagged else None,
                                             an.weight, an.eps, *consts)
        y = self.attn(x, ctx)
        if y.dtype != h.dtype:  # (sublayers return the stream dtype; otherwise the unfused calls, as before)
            h = hc_expand(h, y, post, comb)
            x, pre_f, post, comb = fused_mhc.enter(h, *self._fused_mix("ffn"), pre if lagged else None,
                                                   fnorm.weight, fnorm.eps, *consts)
        else:
            h, x, pre_f, post, comb = fused_mhc.boundary(h, y, post, comb, *self._fused_mix("ffn"),
                                                         pre if lagged else None, fnorm.weight, fnorm.eps, *consts)
        y = self.ffn(x, ctx.input_ids)
        return (fused_mhc.leave(h, y, post, comb) if y.dtype == h.dtype else hc_expand(h, y, post, comb)), pre_f

    def _forward_chunked(self, h: torch.Tensor, pre_prev: torch.Tensor | None, ctx: StepContext,
                         lagged: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`'s sublayers with the mHC passes of `model/mhc_chunked.py` (inference: same bits)."""
        x, mix_a = hc_enter(h, self._hc_weights("attn"), pre_prev if lagged else None)
        y = self.attn(self.attn_norm(x), ctx)
        h, x, mix_f = hc_boundary(h, y, mix_a, self._hc_weights("ffn"), mix_a.pre if lagged else None)
        assert x is not None and mix_f is not None
        h, _, _ = hc_boundary(h, self.ffn(self.ffn_norm(x), ctx.input_ids), mix_f, None)
        return h, mix_f.pre


class Transformer(nn.Module):
    """DeepSeek-V4 / V4.1 backbone over a ragged `StepBatch` (see module doc)."""

    def __init__(self, cfg: ModelConfig, topo: Topology | None = None, quant: bool | QuantMode = True,
                 tokenizer: object | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.engram_hash = engram_hasher(cfg, tokenizer) if cfg.engram_layer_ids else None
        self.engram_lookback = cfg.engram_max_ngram_size - 1 if cfg.engram_layer_ids else 0
        self.topo = topo if topo is not None else Topology(cfg)
        self.quant = QuantMode.of(quant)
        self.quantizer = KVQuantizer(cfg, self.quant)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, self.topo, layer, self.quant, self.quantizer)
                                    for layer in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = plain_linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.arch == "v4":
            self.hc_head_fn = nn.Parameter(torch.zeros(cfg.hc_mult, cfg.hc_mult * cfg.hidden_size))
            self.hc_head_base = nn.Parameter(torch.zeros(cfg.hc_mult))
            self.hc_head_scale = nn.Parameter(torch.ones(1))
        rd = cfg.qk_rope_head_dim
        self.rope_main = RotaryEmbedding(rd, cfg.rope_theta, None)
        self.rope_compress = RotaryEmbedding(rd, cfg.compress_rope_theta, cfg.yarn)
        self.tie_log: list[tuple[int, str, int]] | None = None
        self.kernels = KernelChoice.reference()
        self.bind(switches.default_choice())

    def bind(self, choice: KernelChoice) -> None:
        """Bind every layer's implementation to `choice` (the engine does this once, when it builds
        the model; see `kvshare.layers`)."""
        self.kernels = choice
        bind_model(self, choice)

    @property
    def batch_invariant(self) -> bool:
        """Whether every row is computed alone (ops/invariant.py): its bits do not depend on the rest of the step."""
        return self.kernels.batch_invariant

    @batch_invariant.setter
    def batch_invariant(self, on: bool) -> None:
        self.bind(self.kernels.with_(batch_invariant=bool(on)))

    def set_quant(self, quant: bool | QuantMode) -> None:
        """Switch fake-quantisation for subsequent forwards (all modules share one QuantMode)."""
        new = QuantMode.of(quant)
        self.quant.cache, self.quant.index, self.quant.act = new.cache, new.index, new.act

    def record_ties(self, on: bool = True) -> None:
        """Start (or stop) collecting exact top-k boundary ties into `tie_log` (layer, kind, rows)."""
        self.tie_log = [] if on else None

    def forward(self, input_ids: torch.Tensor, batch: StepBatch, cache: CacheBackend,
                state: StepState | None = None) -> torch.Tensor:
        """Logits [R, vocab] (fp32, or float64 in a float64 model) for R = batch.logit_rows, or every token row.

        `state` (optional, must be fresh) receives this step's hand-offs so a caller can inspect
        them afterwards (top-k per index source, the candidate mask); by default a new one is used.
        """
        w = self.embed.weight
        with invariant.active(self.batch_invariant), native.forward_scope(w.dtype, w.device):
            return self._forward(input_ids, batch, cache, state)

    def _forward(self, input_ids: torch.Tensor, batch: StepBatch, cache: CacheBackend,
                 state: StepState | None) -> torch.Tensor:
        cfg = self.cfg
        state = state if state is not None else StepState()
        ctx = StepContext(batch, cache, state, input_ids, self.rope_main, self.rope_compress, self.tie_log)
        if self.engram_hash is not None:
            ctx.engram_ids = self.engram_hash(*lookback_ids(input_ids, batch, self.engram_lookback + 1))
        x = self.embed(input_ids)
        h = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        pre = identity_pre(h.shape[0], cfg.hc_mult, h.device) if cfg.arch == "v41" else None
        for block in self.layers:
            h, pre = block(h, pre, ctx)
        if batch.logit_rows is not None:
            h = h[batch.logit_rows]
            pre = pre[batch.logit_rows] if pre is not None else None
        if invariant.is_on() and native.serves(h) and _fused_mhc_serves(cfg):  # the tail in one call (same bits)
            if cfg.arch == "v4":
                x = fused_mhc.head(h, None, self.norm.weight, self.norm.eps, cfg.rms_norm_eps, cfg.hc_eps,
                                   _fp32_pack(self.hc_head_fn), self.hc_head_base, self.hc_head_scale)
            else:
                x = fused_mhc.head(h, pre, self.norm.weight, self.norm.eps, cfg.rms_norm_eps, cfg.hc_eps)
            return wide(self.head(x))
        if cfg.arch == "v4":
            pre = hc_head_pre(h, self.hc_head_fn, self.hc_head_base, self.hc_head_scale,
                              rms_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps)
        return wide(self.head(self.norm(hc_collapse(h, pre))))

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> "Transformer":
        """Deterministic random weights with unit-scale activations, for tiny tests (CPU generator).

        Linear weights ~ N(0, 1/in); norms 1; sinks, APE, gate bias ~ N(0, 0.1..0.5); mHC `fn` small so
        the mixes are O(1); `base` random so streams differ; hash tables random distinct experts.
        """
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "weight" and p.dim() == 1:
                val = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
            elif name == "embed.weight":
                val = torch.randn(p.shape, generator=g)
            elif leaf == "weight":
                val = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1])
            elif leaf == "attn_sink":
                val = 0.5 * torch.randn(p.shape, generator=g)
            elif leaf in ("ape", "bias"):
                val = 0.3 * torch.randn(p.shape, generator=g)
            elif leaf.endswith("_fn"):
                val = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1])
            elif leaf.endswith("_base"):
                val = 0.5 * torch.randn(p.shape, generator=g)
            elif leaf.endswith("_scale") or leaf in ("q_weight", "k_weight"):
                val = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
            else:
                raise RuntimeError(f"init_weights: no rule for parameter {name}")
            p.copy_(val.to(p.dtype))
        for name, buf in self.named_buffers():
            if name.endswith("tid2eid"):
                n_exp = self.cfg.n_routed_experts
                perm = torch.argsort(torch.rand(buf.shape[0], n_exp, generator=g), dim=1)
                buf.copy_(perm[:, : buf.shape[1]])
        rows = self.cfg.engram_num_embeddings
        self.attach_engram_tables({lid: EngramTable.random(n, self.cfg.engram_head_dim, g)
                                   for lid, n in zip(self.cfg.engram_layer_ids, rows)})
        return self

    def engram_tables(self) -> dict[int, EngramTable]:
        """The attached Engram table of each Engram layer (layer id -> table)."""
        return {b.engram.layer: b.engram.table for b in self.layers if b.engram is not None and b.engram.table is not None}

    def attach_engram_tables(self, tables: dict[int, EngramTable]) -> None:
        """Give each Engram layer its table (they stay on the CPU whatever the model's device)."""
        for lid, n in zip(self.cfg.engram_layer_ids, self.cfg.engram_num_embeddings):
            t = tables[lid]
            if (t.rows, t.dim) != (n, self.cfg.engram_head_dim):
                raise ValueError(f"layer {lid}: Engram table is {t.rows} x {t.dim}, the config needs "
                                 f"{n} x {self.cfg.engram_head_dim}")
            self.layers[lid].engram.table = t

