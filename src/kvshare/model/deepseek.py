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
from kvshare.kernels.pack_memo import per_generation
from kvshare.layers import KernelChoice, bind_model
from kvshare.layers import switches
from kvshare.layers.mhc import HcWeights, Mhc
from kvshare.model.attention import Attention
from kvshare.step.context import StepContext
from kvshare.model.engram import Engram, engram_hasher, lookback_ids
from kvshare.model.engram_table import EngramTable
from kvshare.layers.linear import plain_linear
from kvshare.layers.mhc_torch import identity_pre
from kvshare.model.moe import MoE
from kvshare.layers.norm import RMSNorm
from kvshare.model.quantize import KVQuantizer, QuantMode
from kvshare.layers.rope import RotaryEmbedding
from kvshare.precision import wide
from kvshare.step import CacheBackend, StepBatch, StepState
from kvshare.topology import Topology


class Block(nn.Module):
    """One backbone layer: mHC-wrapped attention sublayer, then mHC-wrapped MoE sublayer (`mhc`, a
    parameterless bound layer, runs the mixes with this block's ``hc_{attn,ffn}_*`` parameters)."""

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
        self.mhc = Mhc(cfg.arch == "v41", cfg.hidden_size, cfg.rms_norm_eps, cfg.hc_eps)

    def _hc_weights(self, sub: str) -> HcWeights:
        """Sublayer `sub`'s ("attn" / "ffn") mHC parameters and constants (gathered again after any
        parameter registration: a replaced Parameter is seen)."""
        cfg = self.cfg
        return per_generation(self, f"_hc_weights_{sub}", lambda: HcWeights(
            getattr(self, f"hc_{sub}_fn"), getattr(self, f"hc_{sub}_base"), getattr(self, f"hc_{sub}_scale"),
            cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters))

    def forward(self, h: torch.Tensor, pre_prev: torch.Tensor | None,
                ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(streams after the block, the `pre` the next sublayer collapses with in V4.1)."""
        if self.engram is not None:  # pre_prev stays: it was computed from the pre-Engram stream (§7.1)
            assert ctx.engram_ids is not None
            h = self.engram(h, ctx.engram_ids[:, self.engram.index])
        taps = ctx.state.taps if ctx.state is not None else None
        if taps is not None and self.attn.layer in taps:  # DSpark: the stream entering this layer (after
            taps[self.attn.layer] = h.mean(dim=1)  # its Engram, spec engram_dspark.md §4 Q1)
        x, mix = self.mhc.enter(h, self._hc_weights("attn"), self.attn_norm, pre_prev)
        h, x, mix = self.mhc.boundary(h, self.attn(x, ctx), mix, self._hc_weights("ffn"), self.ffn_norm)
        return self.mhc.leave(h, self.ffn(x, ctx.input_ids), mix), mix.pre


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
        self.mhc = Mhc(cfg.arch == "v41", cfg.hidden_size, cfg.rms_norm_eps, cfg.hc_eps)  # the head's collapse
        self.tie_log: list[tuple[int, str, int]] | None = None
        self.bind(switches.default_choice())

    def bind(self, choice: KernelChoice) -> None:
        """Bind every layer's implementation to `choice` (the engine does this once, when it builds
        the model; see `kvshare.layers`). A model whose weights are not bf16 / fp32 on the CPU binds
        without the native kernels (they take only those); `.to(...)` rebinds (`_apply`)."""
        self.kernels = choice
        bound = self.bound
        for child in self.children():
            bind_model(child, bound)
        self.quantizer.bind(bound)

    @property
    def bound(self) -> KernelChoice:
        """What the layers run: `kernels`, less the native kernels where the weights are not bf16 /
        fp32 on the CPU."""
        w = self.embed.weight
        if w.device.type != "cpu" or w.dtype not in (torch.bfloat16, torch.float32):
            return self.kernels.with_(native=False)
        return self.kernels

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 (nn.Module's signature)
        out = super()._apply(fn, recurse)
        self.bind(self.kernels)  # the layers' choices depend on the weights' dtype and device
        return out

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
        head_mix = None
        if cfg.arch == "v4":  # V4 collapses with the hc_head mixes' pre, V4.1 with the last sublayer's
            head_mix = HcWeights(self.hc_head_fn, self.hc_head_base, self.hc_head_scale, cfg.rms_norm_eps,
                                 cfg.hc_eps, 0)
        return wide(self.head(self.mhc.head(h, pre, self.norm, head_mix)))

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

