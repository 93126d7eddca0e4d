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

Inside a batch-invariant forward with the native kernels (and all experts local) everything after
the gate is one native call (`kernels/moe.py`: grouping, GEMMs, SwiGLU, FP8 rounding, combine; no
host read); the torch code below is the reference it matches bitwise, and runs for expert
parallelism, the batched mode and where the kernels do not serve the weights.

Checkpoint names: ``gate.weight``, ``gate.bias`` (non-hash), ``gate.tid2eid`` (V4 hash layers),
``experts.{E}.{w1,w2,w3}.weight``, ``shared_experts.{w1,w2,w3}.weight``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvshare.config import ModelConfig
from kvshare.kernels import decode as native
from kvshare.kernels import moe as native_moe
from kvshare.model.linear import Linear, QLinear
from kvshare.model.quantize import QuantMode, act_quant, fit_block
from kvshare.ops import stable_topk
from kvshare.ops.invariant import is_on as invariant_on, matmul_t, native_pack, pointwise
from kvshare.precision import wide


def _native(*tensors: torch.Tensor) -> bool:
    """Whether the native MoE kernels (`kernels.decode.swiglu` / `moe_combine`, the same bits) serve
    these tensors: inside a batch-invariant forward, bf16 / fp32 CPU tensors without autograd."""
    return invariant_on() and native.serves(*tensors)


def _sum_in_order(w: torch.Tensor) -> torch.Tensor:
    """[T, 1]: each row of w [T, k] summed from its first column to its last (a fixed order, which
    the native gate keeps too; torch's own sum over a row of 5 or more may pair the terms)."""
    s = w[:, :1]
    for j in range(1, w.shape[1]):
        s = s + w[:, j:j + 1]
    return s


class Expert(nn.Module):
    """One SwiGLU expert with clamped gate/up (FP8/FP4 weights: inputs act-quantised)."""

    def __init__(self, dim: int, inter: int, limit: float, mode: QuantMode, block: int) -> None:
        super().__init__()
        self.limit = limit
        self.w1 = QLinear(dim, inter, mode, block)
        self.w2 = QLinear(inter, dim, mode, block)
        self.w3 = QLinear(dim, inter, mode, block)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """SwiGLU of `x` [N, dim]; `weight` [N] (routing weight) scales the hidden before `w2`."""
        gate, up = self.w1(x), self.w3(x)
        if self.limit > 0:
            gate = gate.clamp(max=self.limit)
            up = up.clamp(-self.limit, self.limit)
        hidden = pointwise(F.silu, gate) * up
        if weight is not None:
            hidden = (wide(hidden) * weight.unsqueeze(-1)).to(x.dtype)
        return self.w2(hidden)


class Gate(nn.Module):
    """Router of one MoE layer. `hash_routed`: V4's frozen token -> experts table."""

    def __init__(self, cfg: ModelConfig, hash_routed: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.hash_routed = hash_routed
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        if hash_routed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.int64))
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, expert ids [T, k] int64)."""
        cfg = self.cfg
        k = cfg.num_experts_per_tok
        temp = cfg.gate_temp if cfg.arch == "v41" else 1.0
        normalize = cfg.arch == "v4" or (cfg.norm_topk_prob and k > 1)
        native_route = (invariant_on() and cfg.scoring_func in ("sqrtsoftplus", "sigmoid") and _native(x)
                        and (self.hash_routed or self.bias.dtype == torch.float32))
        packed = native_pack(self.weight) if native_route else None
        if packed is not None and packed.fmt == "fp32":  # the whole gate in one call, the same bits
            if self.hash_routed:  # the experts of each token id (V4's first layers), their scores
                return native.moe_gate(x, packed, None, k, cfg.scoring_func, temp, normalize,
                                       cfg.routed_scaling_factor, self.tid2eid[input_ids])
            return native.moe_gate(x, packed, self.bias, k, cfg.scoring_func, temp, normalize, cfg.routed_scaling_factor)
        logits = matmul_t(wide(x), wide(self.weight))
        if temp != 1.0:
            logits = logits / temp
        if native_route and not self.hash_routed and logits.dtype == torch.float32:  # the same bits and picks
            weights, ids = native.moe_route(logits, self.bias, k, cfg.scoring_func)
        else:
            weights, ids = self._route(logits, input_ids)
        if normalize:
            weights = weights / (_sum_in_order(weights) + 1e-20)
        return weights * cfg.routed_scaling_factor, ids


    def _route(self, logits: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores of the picks [T, k], picks [T, k]) from the gate logits (the torch code)."""
        cfg = self.cfg
        if cfg.scoring_func == "softmax":
            scores = logits.softmax(dim=-1)
        elif cfg.scoring_func == "sigmoid":
            scores = pointwise(torch.sigmoid, logits)
        else:
            scores = pointwise(F.softplus, logits).sqrt()
        if self.hash_routed:
            ids = self.tid2eid[input_ids].long()
        else:
            _, ids = stable_topk(scores + wide(self.bias), cfg.num_experts_per_tok)
        return scores.gather(1, ids), ids


class MoE(nn.Module):
    """Routed experts plus the shared expert."""

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

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Routed + shared expert outputs for tokens x [T, D] (see the class doc for the layout)."""
        t, k = x.shape[0], self.gate.cfg.num_experts_per_tok
        weights, ids = self.gate(x, input_ids)
        if self.reduce is None and _native(x) and weights.dtype == torch.float32:
            y = self._native_experts(x, ids, weights)
            if y is not None:
                return y
        flat, flat_w = ids.flatten(), weights.flatten()
        order = torch.argsort(flat, stable=True)
        # the one host read of the layer (a fixed-shape count: bincount would also size its output
        # from the data, a second sync on an accelerator)
        counts = flat.new_zeros(self.gate.cfg.n_routed_experts).index_add_(0, flat, torch.ones_like(flat)).tolist()
        lo, hi = self.expert_offset, self.expert_offset + len(self.experts)
        first = sum(counts[:lo])
        sel = order[first:first + sum(counts[lo:hi])]  # local slots, grouped by expert, stable
        groups = [(self.experts[e - lo], n) for e, n in enumerate(counts) if n and lo <= e < hi]
        groups.append((self.shared_experts, t))
        rows = torch.cat([torch.div(sel, k, rounding_mode="floor"), torch.arange(t, device=x.device)])
        row_w = torch.cat([flat_w[sel], flat_w.new_ones(t)])
        out = _run_experts(groups, x[rows], row_w)
        n_sel = sel.numel()
        if invariant_on() and n_sel == t * k and self.reduce is None and _native(out) and sel.is_contiguous():  # same bits, one call
            return native.moe_combine(out, sel, t, k)
        if n_sel == t * k:  # every slot is local: gather each token's k outputs in slot order
            where = torch.empty_like(sel)
            where[sel] = torch.arange(n_sel, device=x.device)
            slots = out[where]
        else:  # expert parallelism: slots routed to other ranks stay zero
            slots = torch.zeros(t * k, x.shape[1], dtype=x.dtype, device=x.device)
            slots[sel] = out[:n_sel]
        routed = wide(slots.view(t, k, -1)).sum(dim=1)
        if self.reduce is not None:  # may hand back a tensor its caller keeps: add out of place
            return (self.reduce(routed) + wide(out[n_sel:])).to(x.dtype)
        return routed.add_(wide(out[n_sel:])).to(x.dtype)

    def _native_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
        """The experts and the combine in one native call (`kernels.moe`: the same bits as the torch
        path below, no host read), or None where it does not serve this layer or these inputs."""
        packs = self.__dict__.get("_native_packs")
        for _ in range(2):  # a pack set found stale is rebuilt once
            if not native_moe.fresh(packs):
                packs = self.__dict__["_native_packs"] = self._pack_set()
            if packs is None or x.dtype != packs.act_dtype:
                return None
            e0 = self.shared_experts
            blk = e0.w1.block if e0.w1.mode.act else 0
            xb, hb = (fit_block(x.shape[1], blk), fit_block(e0.w1.out_features, blk)) if blk else (0, 0)
            y = native_moe.experts(x, ids, weights, packs, e0.limit, xb, hb)
            if y is not None:
                return y
            packs = None
        return None

    def _pack_set(self) -> native_moe.LayerPacks | None:
        """Every expert's w1 / w3 / w2 pack (routed experts, then the shared one), or None where the
        layer is split over ranks or a linear has no native pack."""
        if self.expert_offset != 0 or len(self.experts) != self.gate.cfg.n_routed_experts:
            return None
        linears = []
        for e in [*self.experts, self.shared_experts]:
            for lin in (e.w1, e.w3, e.w2):
                if lin.qweight is not None:
                    linears.append((lin.qweight, lin.qweight.data))
                    continue
                p = native_pack(lin.weight)
                if p is None:
                    return None
                linears.append((p, lin.weight))
        return native_moe.pack_set(linears)


#: rows per expert group from which `_run_experts` runs each group's SwiGLU right after its GEMMs
#: (prefill: the group's activations stay in cache); below it the element-wise work of all groups
#: runs as one batch (decode: few rows per expert, so per-op overhead dominates)
PER_GROUP_MIN_ROWS = 64


def _run_experts(groups: list[tuple[Expert, int]], xs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`Expert.forward` for consecutive row groups of xs [N, D] with routing weights [N].

    Group i is the next ``n_i`` rows for expert i. Every step is row-wise and each GEMM sees the
    same rows in the same order as a per-expert call, so the result is bitwise
    `Expert.forward(rows, weight)` per group whichever way the element-wise work is arranged (the
    shared expert's weight 1 is exact: ``wide(h) * 1`` rounds back to h).
    """
    e0 = groups[0][0]
    act, block = e0.w1.mode.act, e0.w1.block
    if act:
        xs = act_quant(xs, block)
    bounds, start = [], 0
    for _, n in groups:
        bounds.append((start, start + n))
        start += n
    if xs.shape[0] >= PER_GROUP_MIN_ROWS * len(groups):
        out = xs.new_empty(xs.shape[0], e0.w2.out_features)
        for (e, _), (a, b) in zip(groups, bounds):
            hidden = _swiglu(Linear.forward(e.w1, xs[a:b]), Linear.forward(e.w3, xs[a:b]), weight[a:b], e.limit)
            out[a:b] = Linear.forward(e.w2, act_quant(hidden, block) if act else hidden)
        return out
    gate = torch.cat([Linear.forward(e.w1, xs[a:b]) for (e, _), (a, b) in zip(groups, bounds)])
    up = torch.cat([Linear.forward(e.w3, xs[a:b]) for (e, _), (a, b) in zip(groups, bounds)])
    hidden = _swiglu(gate, up, weight, e0.limit)
    if act:
        hidden = act_quant(hidden, block)
    return torch.cat([Linear.forward(e.w2, hidden[a:b]) for (e, _), (a, b) in zip(groups, bounds)])


def _swiglu(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, limit: float) -> torch.Tensor:
    """``(wide(silu(min(gate, limit)) * clamp(up)) * weight).to(gate.dtype)``, overwriting the fresh
    GEMM outputs gate and up (in-place ops: the same values as `Expert.forward`'s)."""
    if (invariant_on() and weight.dtype == torch.float32 and _native(gate, up) and gate.is_contiguous()
            and up.is_contiguous()):
        return native.swiglu(gate, up, weight.contiguous(), limit)  # the same bits in one call
    if limit > 0:
        gate.clamp_(max=limit)
        up.clamp_(-limit, limit)
    hidden = pointwise(lambda g: F.silu(g, inplace=True), gate).mul_(up)
    return wide(hidden).mul_(weight.unsqueeze(-1)).to(gate.dtype)
