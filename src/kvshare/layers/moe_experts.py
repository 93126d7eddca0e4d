"""A MoE layer's experts (spec/model.md §7.2) as a bound layer: the torch dispatch (the reference) and
the one-call native experts.

`MoeExperts` is the base of `model/moe.MoE` (which holds the parameters under their checkpoint
names: ``experts.{E}.{w1,w2,w3}``, ``shared_experts.*``, ``gate``). Experts compute
``w2(weight * silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit))`` (no clamp when limit <= 0);
the routing weight multiplies the SwiGLU output *before* ``w2``, so ``w2``'s FP8 input rounding
sees the weighted activations; the shared expert has weight 1. Routed outputs are combined per
token in a fixed order (k slots summed), so results do not depend on how tokens are grouped.

Bound (`select`): `forward_native` for a batch-invariant native choice: everything after the gate in
one native call (`kernels/moe.py`: grouping, GEMMs, SwiGLU, FP8 rounding, combine; no host read),
the reference's bits; `forward_torch` otherwise (also the fallback inside `forward_native` for
expert parallelism, weights the kernels do not pack, another activation dtype).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from kvshare.kernels import decode as native_kernels
from kvshare.kernels import moe as native_moe
from kvshare.layers.bound import BoundOp
from kvshare.layers.choice import KernelChoice
from kvshare.layers.linear import Linear
from kvshare.layers.quant import act_quant, fit_block
from kvshare.ops.invariant import native_pack, pointwise
from kvshare.precision import wide


class MoeExperts(BoundOp):
    """Routed experts plus the shared expert, after the gate (see module doc). Subclasses define
    ``gate``, ``experts``, ``shared_experts``, ``expert_offset`` and ``reduce`` (expert parallelism:
    `experts` holds ids [expert_offset, +len) and `reduce` sums the routed outputs over ranks)."""

    def select(self, choice: KernelChoice) -> Callable[..., Any]:
        return self.forward_native if choice.batch_invariant and choice.native else self.forward_torch

    def forward_torch(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Routed + shared expert outputs for tokens x [T, D]: the reference."""
        weights, ids = self.gate(x, input_ids)
        return self._dispatch(x, ids, weights, False)

    def forward_native(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """The experts and the combine in one native call (`kernels.moe.experts`, the reference's bits,
        no host read); the reference's dispatch with the native SwiGLU / combine where that call does
        not apply (expert parallelism, a weight without a native pack, another activation dtype)."""
        weights, ids = self.gate(x, input_ids)
        if self.reduce is None and weights.dtype == torch.float32:
            y = self._native_experts(x, ids, weights)
            if y is not None:
                return y
        return self._dispatch(x, ids, weights, True)

    def _dispatch(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, native: bool) -> torch.Tensor:
        """The torch dispatch: slots grouped per expert (stable), `_run_experts`, the combine (with
        the native SwiGLU / FP8 rounding / combine where `native`: the same bits)."""
        t, k = x.shape[0], self.gate.cfg.num_experts_per_tok
        invariant = self.choice.batch_invariant
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
        out = _run_experts(groups, x[rows], row_w, native, invariant)
        n_sel = sel.numel()
        if native and n_sel == t * k and self.reduce is None and sel.is_contiguous():
            return native_kernels.moe_combine(out, sel, t, k)  # the same bits in one call
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


def _run_experts(groups: list[tuple[Any, int]], xs: torch.Tensor, weight: torch.Tensor, native: bool = False,
                 invariant: bool = False) -> torch.Tensor:
    """`Expert.forward` for consecutive row groups of xs [N, D] with routing weights [N].

    Group i is the next ``n_i`` rows for expert i. Every step is row-wise and each GEMM sees the
    same rows in the same order as a per-expert call, so the result is bitwise
    `Expert.forward(rows, weight)` per group whichever way the element-wise work is arranged (the
    shared expert's weight 1 is exact: ``wide(h) * 1`` rounds back to h).
    """
    e0 = groups[0][0]
    act, block, native_act = e0.w1.mode.act, e0.w1.block, e0.w1.native_act  # (the QLinears' bound rounding)
    if act:
        xs = act_quant(xs, block, native_act)
    bounds, start = [], 0
    for _, n in groups:
        bounds.append((start, start + n))
        start += n
    if xs.shape[0] >= PER_GROUP_MIN_ROWS * len(groups):
        out = xs.new_empty(xs.shape[0], e0.w2.out_features)
        for (e, _), (a, b) in zip(groups, bounds):
            hidden = _swiglu(Linear.forward(e.w1, xs[a:b]), Linear.forward(e.w3, xs[a:b]), weight[a:b], e.limit, native,
                             invariant)
            out[a:b] = Linear.forward(e.w2, act_quant(hidden, block, native_act) if act else hidden)
        return out
    gate = torch.cat([Linear.forward(e.w1, xs[a:b]) for (e, _), (a, b) in zip(groups, bounds)])
    up = torch.cat([Linear.forward(e.w3, xs[a:b]) for (e, _), (a, b) in zip(groups, bounds)])
    hidden = _swiglu(gate, up, weight, e0.limit, native, invariant)
    if act:
        hidden = act_quant(hidden, block, native_act)
    return torch.cat([Linear.forward(e.w2, hidden[a:b]) for (e, _), (a, b) in zip(groups, bounds)])


def _swiglu(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, limit: float, native: bool = False,
            invariant: bool = False) -> torch.Tensor:
    """``(wide(silu(min(gate, limit)) * clamp(up)) * weight).to(gate.dtype)``, overwriting the fresh
    GEMM outputs gate and up (in-place ops: the same values as `Expert.forward`'s); `native`: in one
    native call where it takes the tensors (the same bits)."""
    if native and weight.dtype == torch.float32 and gate.is_contiguous() and up.is_contiguous():
        return native_kernels.swiglu(gate, up, weight.contiguous(), limit)  # the same bits in one call
    if limit > 0:
        gate.clamp_(max=limit)
        up.clamp_(-limit, limit)
    hidden = pointwise(lambda g: F.silu(g, inplace=True), gate, invariant).mul_(up)
    return wide(hidden).mul_(weight.unsqueeze(-1)).to(gate.dtype)
