"""Linear layers whose input is FP8-rounded when the checkpoint weight is FP8/FP4 (spec/model.md §6).

In DeepSeek's reference every GEMM with an FP8 or FP4 weight quantises its activation to FP8 e4m3
in blocks of `act_quant_block` (32 in V4.1, 128 in V4) with power-of-two scales. bf16/fp32 linears
(`wo_a`, `weights_proj`, `wk`, compressor projections, the MoE gate, the head) see raw inputs;
they are plain `nn.Linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvshare.model.quantize import QuantMode, act_quant


class QLinear(nn.Linear):
    """`nn.Linear` (no bias) standing for an FP8/FP4 checkpoint weight.

    When ``mode.act`` is on, the input is rounded to FP8 (block `block`) before the product; the
    weight itself is used as loaded (the loader dequantises checkpoint weights).
    """

    def __init__(self, in_features: int, out_features: int, mode: QuantMode, block: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.mode = mode
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode.act:
            x = act_quant(x, self.block)
        return F.linear(x, self.weight)


def plain_linear(in_features: int, out_features: int) -> nn.Linear:
    """A bias-free linear whose input is never quantised."""
    return nn.Linear(in_features, out_features, bias=False)
