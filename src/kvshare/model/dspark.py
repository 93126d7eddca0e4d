"""DSpark: V4.1's block drafter (spec engram_dspark.md part 2), attached to a Transformer as ``mtp``.

Structure (§2.2): S stages ``mtp.0 .. mtp.{S-1}``, each a full V4.1 block (mHC, sliding-window
MLA attention with no compressor, a MoE of ``dspark_n_routed_experts`` experts). Stage 0 also has
``main_proj`` [D, D * len(targets)] and ``main_norm``; the last stage ``norm``, ``markov_head``
(``embed`` and ``head``, both [vocab, r]) and ``confidence_head.proj`` [1, D + r]. The token
embedding and the LM head are the target's (never loaded twice).

Per step (§2.3-§2.6):

* ``main_x = main_norm(main_proj(concat_l aux_l))`` where aux_l is the 4-copy mean of the stream
  entering target layer l (`StepState.taps`); each stage writes ``window(rope(kv_norm(wkv(main_x))))``
  of committed tokens into its own window ring (`DraftWindows`).
* Draft block at anchor position a: ids ``[anchor, noise * (B-1)]`` at positions a .. a+B-1 run
  through the stages. Every block query attends to the stage's context rows ``a-W .. a-1`` plus
  all B block rows (non-causal), with the per-head sink. ``U = head(norm(collapse(x)))``.
* Markov correction: ``logits_i = U_i + markov_head.head @ markov_head.embed[prev]``, prev = anchor
  then each chosen draft; confidence ``sigmoid(proj([x_head_i ; embed[prev_i]]))``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from kvshare.config import ModelConfig
from kvshare.errors import ConfigError
from kvshare.model.attention import Attention
from kvshare.layers.mhc import Mhc
from kvshare.model.deepseek import Block, Transformer
from kvshare.model.dspark_window import DraftWindows
from kvshare.layers.linear import QLinear
from kvshare.layers.mhc_torch import hc_collapse, identity_pre
from kvshare.model.moe import MoE
from kvshare.layers.norm import RMSNorm
from kvshare.ops import sparse_attention
from kvshare.precision import wide


@dataclass
class DraftContext:
    """What one draft forward threads through the stages: N blocks of B rows, row-major."""

    input_ids: torch.Tensor  # [N * B]
    positions: torch.Tensor  # [N * B]
    num_blocks: int
    context: dict[int, tuple[torch.Tensor, torch.Tensor]]  # stage layer -> ([N, W, d], [N, W] valid)
    state: None = None  # Block.forward's hand-offs (taps): none inside the drafter


class DSparkAttention(Attention):
    """A stage's attention: the block's own rows plus the stage's context window, non-causal."""

    def forward(self, x: torch.Tensor, ctx: DraftContext) -> torch.Tensor:  # type: ignore[override]
        t, n = x.shape[0], ctx.num_blocks
        b = t // n
        rope, pos = self.rope, ctx.positions
        q = rope.rotate(self.wq_b(self.q_norm(self.wq_a(x))).view(t, self.n_heads, self.head_dim), pos)
        kv = self.block_kv(x, pos)
        win, win_valid = ctx.context[self.layer]
        keys = torch.cat([win.to(kv.dtype), kv.view(n, b, -1)], dim=1)  # [N, W + B, d]
        valid = torch.cat([win_valid, torch.ones(n, b, dtype=torch.bool, device=x.device)], dim=1)
        row_block = torch.arange(n, device=x.device).repeat_interleave(b)
        o = sparse_attention(q, keys[row_block], valid[row_block], self.attn_sink, self.head_dim**-0.5)
        # the drafter runs outside the batch-invariant forward: always the batched torch composition
        return self.project_out.forward_torch(o, pos, rope)

    def block_kv(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Window rows ``round(rope(kv_norm(wkv(x))))`` at `pos` (context writes use the same)."""
        return self.quantizer.window(self.rope.rotate(self.kv_norm(self.wkv(x)), pos))


class DSparkStage(Block):
    """One DSpark stage: Block's mHC + sublayer wiring with DSparkAttention and the stage MoE."""

    def __init__(self, cfg: ModelConfig, model: Transformer, layer: int, first: bool, last: bool,
                 n_targets: int) -> None:
        nn.Module.__init__(self)  # not Block.__init__: it would build the backbone's (larger) MoE
        self.cfg = cfg
        self.engram = None  # stages have no Engram
        d, mode = cfg.hidden_size, model.quant
        n_mix, width = (2 + cfg.hc_mult) * cfg.hc_mult, cfg.hc_mult * d
        stage_cfg = dataclasses.replace(cfg, n_routed_experts=cfg.dspark_n_routed_experts or cfg.n_routed_experts,
                                        num_experts_per_tok=cfg.dspark_num_experts_per_tok or cfg.num_experts_per_tok)
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.attn = DSparkAttention(cfg, model.topo, layer, mode, model.quantizer)
        self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ffn = MoE(stage_cfg, layer, mode)
        for sub in ("attn", "ffn"):
            setattr(self, f"hc_{sub}_fn", nn.Parameter(torch.zeros(n_mix, width)))
            setattr(self, f"hc_{sub}_base", nn.Parameter(torch.zeros(n_mix)))
            setattr(self, f"hc_{sub}_scale", nn.Parameter(torch.ones(3)))
        self.mhc = Mhc(cfg.arch == "v41", d, cfg.rms_norm_eps, cfg.hc_eps)
        if first:
            self.main_proj = QLinear(d * n_targets, d, mode, cfg.act_quant_block)
            self.main_norm = RMSNorm(d, cfg.rms_norm_eps)
        if last:
            r = cfg.dspark_markov_rank
            self.norm = RMSNorm(d, cfg.rms_norm_eps)
            self.markov_head = nn.Module()
            self.markov_head.embed = nn.Embedding(cfg.vocab_size, r)
            self.markov_head.head = nn.Linear(r, cfg.vocab_size, bias=False)
            self.confidence_head = nn.Module()
            self.confidence_head.proj = nn.Linear(d + r, 1, bias=False)


def check_dspark(cfg: ModelConfig) -> None:
    """ConfigError unless `cfg` describes DSpark stages (V4.1, stages, block size, targets)."""
    if cfg.arch != "v41" or cfg.num_draft_layers <= 0 or cfg.dspark_block_size <= 0:
        raise ConfigError("this model has no DSpark draft stages (needs a V4.1 config with "
                          "num_nextn_predict_layers > 0 and dspark_block_size > 0)", field="num_nextn_predict_layers",
                          fix="use a DSpark checkpoint, or drop speculative_config")


def attach_dspark(model: Transformer) -> nn.ModuleList:
    """Build the stages as ``model.mtp`` (parameters zero until loaded or initialised); returns them."""
    cfg = model.cfg
    check_dspark(cfg)
    n, s = cfg.num_hidden_layers, cfg.num_draft_layers
    stages = nn.ModuleList(DSparkStage(cfg, model, n + i, i == 0, i == s - 1, len(cfg.dspark_target_layer_ids))
                           for i in range(s))
    for st in stages:  # the target's main table: theta 10000, no YaRN (§2.1); holds no state_dict entries
        st.attn.rope = model.rope_main
    model.mtp = stages
    return stages


def dspark_shapes(model: Transformer) -> dict[str, tuple[int, ...]]:
    """Released name -> shape of every ``mtp.*`` tensor the model expects (§2.9, dequantised)."""
    return {f"mtp.{k}": tuple(v.shape) for k, v in model.mtp.state_dict().items()}


class DSparkDraft:
    """The draft computations over a Transformer with ``mtp`` attached (see module doc)."""

    def __init__(self, model: Transformer) -> None:
        if not hasattr(model, "mtp"):
            raise ConfigError("the model has no DSpark stages attached", field="speculative_config",
                              fix="load the model with its mtp.* tensors")
        self.model = model
        self.cfg = model.cfg
        self.stages: nn.ModuleList = model.mtp
        self.layers = [self.cfg.num_hidden_layers + i for i in range(len(self.stages))]
        self.targets = tuple(self.cfg.dspark_target_layer_ids)
        self.block = self.cfg.dspark_block_size

    def windows(self, cache: object) -> DraftWindows:
        return DraftWindows(cache, self.cfg.sliding_window, self.cfg.head_dim)

    def main_x(self, taps: dict[int, torch.Tensor | None]) -> torch.Tensor:
        """[T, D] = main_norm(main_proj(concat of the taps in target order))."""
        missing = [t for t in self.targets if taps.get(t) is None]
        if missing:
            raise RuntimeError(f"DSpark: target layers {missing} were not tapped this step")
        s0 = self.stages[0]
        return s0.main_norm(s0.main_proj(torch.cat([taps[t] for t in self.targets], dim=-1)))

    def write_context(self, windows: DraftWindows, main_x: torch.Tensor, slots: torch.Tensor,
                      positions: torch.Tensor) -> None:
        """Store every stage's context row of the committed tokens (rows of main_x)."""
        for layer, st in zip(self.layers, self.stages):
            windows.write(layer, slots, positions, st.attn.block_kv(main_x, positions))

    def block_forward(self, windows: DraftWindows, anchors: torch.Tensor, anchor_pos: torch.Tensor,
                      slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(base logits U [N, B, vocab], pre-norm collapsed hidden x_head [N, B, D]) of N blocks."""
        dtype = self.model.embed.weight.dtype
        context = {layer: windows.read(layer, slots, anchor_pos, dtype) for layer in self.layers}
        return self.run_block(anchors, anchor_pos, context)

    def run_block(self, anchors: torch.Tensor, anchor_pos: torch.Tensor,
                  context: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """`block_forward` given each stage's context rows ([N, W, d], [N, W] valid) directly
        (training builds them from the target's taps without a cache)."""
        cfg, m, n, b = self.cfg, self.model, anchors.shape[0], self.block
        ids = torch.full((n, b), cfg.dspark_noise_token_id, dtype=torch.int64, device=anchors.device)
        ids[:, 0] = anchors
        ids = ids.flatten()
        pos = (anchor_pos[:, None] + torch.arange(b, device=anchors.device)[None, :]).flatten()
        ctx = DraftContext(ids, pos, n, context)
        x = m.embed(ids)
        h = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        pre = identity_pre(h.shape[0], cfg.hc_mult, h.device)
        for st in self.stages:
            h, pre = st(h, pre, ctx)
        x_head = hc_collapse(h, pre)
        last = self.stages[-1]
        u = wide(m.head(last.norm(x_head)))
        return u.view(n, b, -1), x_head.view(n, b, -1)

    def markov_bias(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(bias [N, vocab] = head @ embed[prev], the Markov embedding [N, r])."""
        mh = self.stages[-1].markov_head
        e = mh.embed(prev)
        return wide(e) @ wide(mh.head.weight).t(), e

    def confidence(self, x_head: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        """sigmoid(proj([x_head ; m])) per row (feeds statistics only; never changes outputs)."""
        proj = self.stages[-1].confidence_head.proj
        z = torch.cat([wide(x_head), wide(markov_embed)], dim=-1) @ wide(proj.weight).t()
        return torch.sigmoid(z.squeeze(-1))
