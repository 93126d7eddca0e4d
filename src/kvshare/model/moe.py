"""Mixture of experts (spec/model.md §7.2): gate, routed SwiGLU experts, one shared expert.

Gate: ``logits = x W^T`` in fp32 (V4.1 divides by `gate_temp`); scores = sqrt(softplus(logits))
(or softmax / sigmoid). Selection = top-k of ``scores + bias`` (bias for selection only), ties
toward the lower expert id (§13); V4 hash layers select ``tid2eid[token]`` instead. Weights = the
unbiased scores of the picks, renormalised (V4: always, + 1e-20; V4.1: only when
`norm_topk_prob` and k > 1, + 1e-20), times `routed_scaling_factor`.

Experts: ``w2(weight * silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit))`` (no clamp when
limit <= 0). The routing weight multiplies the SwiGLU output *before* ``w2`` (§7.2), so ``w2``'s
FP8 input quantisation sees the weighted activations; the shared expert has weight 1. Routed
outputs are combined per token in a fixed order (k slots summed), so results do not depend on how
tokens are grouped per expert.

The gate is `layers/moe_gate.Gate`; what runs the experts (the torch dispatch, or one native call
for a batch-invariant native model) is bound once (`layers/moe_experts.MoeExperts`).

Checkpoint names: ``gate.weight``, ``gate.bias`` (non-hash), ``gate.tid2eid`` (V4 hash layers),
``experts.{E}.{w1,w2,w3}.weight``, ``shared_experts.{w1,w2,w3}.weight``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvshare.config import ModelConfig
from kvshare.layers.choice import KernelChoice
from kvshare.layers.moe_experts import MoeExperts, _run_experts, _swiglu
from kvshare.layers.moe_gate import Gate
from kvshare.layers.linear import QLinear
from kvshare.model.quantize import QuantMode
from kvshare.ops.invariant import pointwise
from kvshare.precision import wide

__all__ = ["Expert", "Gate", "MoE", "_run_experts", "_swiglu"]


class Expert(nn.Module):
    """One SwiGLU expert with clamped gate/up (FP8/FP4 weights: inputs act-quantised)."""

    def __init__(self, dim: int, inter: int, limit: float, mode: QuantMode, block: int) -> None:
        super().__init__()
        self.limit = limit
        self.w1 = QLinear(dim, inter, mode, block)
        self.w2 = QLinear(inter, dim, mode, block)
        self.w3 = QLinear(dim, inter, mode, block)
        self.invariant = False  # the SiLU through `ops.invariant.pointwise`'s vector loop (`bind`)

    def bind(self, choice: KernelChoice) -> None:
        self.invariant = choice.batch_invariant

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """SwiGLU of `x` [N, dim]; `weight` [N] (routing weight) scales the hidden before `w2`."""
        gate, up = self.w1(x), self.w3(x)
        if self.limit > 0:
            gate = gate.clamp(max=self.limit)
            up = up.clamp(-self.limit, self.limit)
        hidden = pointwise(F.silu, gate, self.invariant) * up
        if weight is not None:
            hidden = (wide(hidden) * weight.unsqueeze(-1)).to(x.dtype)
        return self.w2(hidden)


class MoE(MoeExperts):
    """Routed experts plus the shared expert; the implementation is bound (`layers/moe_experts.py`)."""

    def __init__(self, cfg: ModelConfig, layer: int, mode: QuantMode) -> None:
        super().__init__()
        inter, blk, lim = cfg.moe_intermediate_size, cfg.act_quant_block, cfg.swiglu_limit
        self.gate = Gate(cfg, hash_routed=cfg.arch == "v4" and layer < cfg.num_hash_layers)
        self.experts = nn.ModuleList(Expert(cfg.hidden_size, inter, lim, mode, blk)
                                     for _ in range(cfg.n_routed_experts))
        self.shared_experts = Expert(cfg.hidden_size, inter, lim, mode, blk)
        # Expert parallelism (kvshare.parallel): `experts` holds ids [expert_offset, +len) and
        # `reduce` sums the routed outputs over ranks before the shared expert is added.
        self.expert_offset = 0
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
