"""The MoE gate (spec/model.md §7.2) as a bound layer: the torch reference and the native gate.

``logits = x W^T`` in fp32 (V4.1 divides by `gate_temp`); scores = sqrt(softplus(logits)) (or
softmax / sigmoid); selection = top-k of ``scores + bias`` (bias for selection only), ties toward
the lower expert id; V4 hash layers select ``tid2eid[token]`` instead. Weights = the unbiased scores
of the picks, renormalised (V4: always; V4.1: when `norm_topk_prob` and k > 1; + 1e-20, summed left
to right), times `routed_scaling_factor`. The native gate (`kernels.decode.moe_gate` / `moe_route`)
gives the reference's bits and picks.

Checkpoint names: ``gate.weight``, ``gate.bias`` (non-hash), ``gate.tid2eid`` (V4 hash layers).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvshare.config import ModelConfig
from kvshare.kernels import decode as native_kernels
from kvshare.layers.bound import BoundOp
from kvshare.layers.choice import KernelChoice
from kvshare.ops import stable_topk
from kvshare.ops.invariant import matmul_t, native_pack, pointwise
from kvshare.precision import wide


def _sum_in_order(w: torch.Tensor) -> torch.Tensor:
    """[T, 1]: each row of w [T, k] summed from its first column to its last (a fixed order, which
    the native gate keeps too; torch's own sum over a row of 5 or more may pair the terms)."""
    s = w[:, :1]
    for j in range(1, w.shape[1]):
        s = s + w[:, j:j + 1]
    return s


class Gate(BoundOp):
    """Router of one MoE layer. `hash_routed`: V4's frozen token -> experts table.

    Bound (`select`): `forward_native` for a batch-invariant native choice with a score the kernel
    has (sqrt(softplus) / sigmoid) and an fp32 bias (or hash routing); else `forward_torch` (the
    reference; row-invariant products and scores for a batch-invariant choice).
    """

    def __init__(self, cfg: ModelConfig, hash_routed: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.hash_routed = hash_routed
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        if hash_routed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.int64))
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts))

    def select(self, choice: KernelChoice) -> Callable[..., Any]:
        if not (choice.batch_invariant and choice.native):
            return self.forward_torch
        native = self.cfg.scoring_func in ("sqrtsoftplus", "sigmoid") and (
            self.hash_routed or self.bias.dtype == torch.float32)
        return self.forward_native if native else self.forward_torch

    def _shape(self) -> tuple[int, float, bool]:
        """(k, the logits' temperature, whether the weights are renormalised)."""
        cfg = self.cfg
        k = cfg.num_experts_per_tok
        return k, (cfg.gate_temp if cfg.arch == "v41" else 1.0), cfg.arch == "v4" or (cfg.norm_topk_prob and k > 1)

    def forward_torch(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, expert ids [T, k] int64): the reference."""
        _, temp, normalize = self._shape()
        invariant = self.choice.batch_invariant
        logits = matmul_t(wide(x), wide(self.weight), invariant)
        if temp != 1.0:
            logits = logits / temp
        weights, ids = self._route(logits, input_ids, invariant)
        return self._scaled(weights, normalize), ids

    def forward_native(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate in one native call (`kernels.decode.moe_gate`, the reference's bits and picks); for a
        weight without an fp32 pack, the row-invariant logits and the native routing."""
        cfg = self.cfg
        k, temp, normalize = self._shape()
        packed = native_pack(self.weight)
        if packed is not None and packed.fmt == "fp32":
            if self.hash_routed:  # the experts of each token id (V4's first layers), their scores
                return native_kernels.moe_gate(x, packed, None, k, cfg.scoring_func, temp, normalize,
                                               cfg.routed_scaling_factor, self.tid2eid[input_ids])
            return native_kernels.moe_gate(x, packed, self.bias, k, cfg.scoring_func, temp, normalize,
                                           cfg.routed_scaling_factor)
        logits = matmul_t(wide(x), wide(self.weight), True)
        if temp != 1.0:
            logits = logits / temp
        if not self.hash_routed and logits.dtype == torch.float32:  # the same bits and picks
            weights, ids = native_kernels.moe_route(logits, self.bias, k, cfg.scoring_func)
        else:
            weights, ids = self._route(logits, input_ids, True)
        return self._scaled(weights, normalize), ids

    def _scaled(self, weights: torch.Tensor, normalize: bool) -> torch.Tensor:
        if normalize:
            weights = weights / (_sum_in_order(weights) + 1e-20)
        return weights * self.cfg.routed_scaling_factor

    def _route(self, logits: torch.Tensor, input_ids: torch.Tensor, invariant: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores of the picks [T, k], picks [T, k]) from the gate logits (the torch code)."""
        cfg = self.cfg
        if cfg.scoring_func == "softmax":
            scores = logits.softmax(dim=-1)
        elif cfg.scoring_func == "sigmoid":
            scores = pointwise(torch.sigmoid, logits, invariant)
        else:
            scores = pointwise(F.softplus, logits, invariant).sqrt()
        if self.hash_routed:
            ids = self.tid2eid[input_ids].long()
        else:
            _, ids = stable_topk(scores + wide(self.bias), cfg.num_experts_per_tok)
        return scores.gather(1, ids), ids
