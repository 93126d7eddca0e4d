"""MoE with all experts' element-wise work batched (model/moe.py `_run_experts`).

1. float64, FP8 input rounding on, SwiGLU clamp on: `MoE.forward` equals spec/model.md §7.2
   written out here per token (router, top-k, renormalised weights, per-expert clamped SwiGLU with
   the routing weight before w2, FP8 e4m3 / ue8m0 block rounding of each expert GEMM input, shared
   expert with weight 1), to float64 rounding.
2. bf16 and fp32 (with and without FP8 rounding): bitwise equal to calling each `Expert` on its
   own rows (the per-expert loop the batching replaced), for decode- and prefill-sized inputs.
3. expert parallelism: two halves (`expert_offset`, `reduce`) sum to the whole layer.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from kvshare.model.moe import MoE
from kvshare.model.quantize import QuantMode
from kvshare.precision import wide
from test_model_common import get_config


def _moe(dtype: torch.dtype, act: bool, k: int = 2, seed: int = 0) -> MoE:
    """tiny-v41's layer-0 MoE with `k` experts per token and random weights (also test_moe_native's)."""
    cfg = dataclasses.replace(get_config("tiny-v41"), num_experts_per_tok=k)
    moe = MoE(cfg, 0, QuantMode(False, False, act))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.4)
    return moe.to(dtype).eval()


def _fp8(x: torch.Tensor, block: int) -> torch.Tensor:
    """e4m3 rounding in blocks along the last dim with power-of-two (ue8m0) scales, by hand."""
    xb = x.reshape(*x.shape[:-1], -1, block)
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4)
    scale = 2.0 ** torch.ceil(torch.log2(amax / 448.0))
    q = (xb / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype)
    return (q * scale).reshape(x.shape)


def _spec_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    cfg, blk, lim = moe.gate.cfg, moe.gate.cfg.act_quant_block, moe.gate.cfg.swiglu_limit
    k = cfg.num_experts_per_tok

    def expert(e: torch.nn.Module, row: torch.Tensor, w: float) -> torch.Tensor:
        xq = _fp8(row, blk)
        gate = (xq @ e.w1.weight.t()).clamp(max=lim)
        up = (xq @ e.w3.weight.t()).clamp(-lim, lim)
        return _fp8(w * F.silu(gate) * up, blk) @ e.w2.weight.t()

    out = []
    for row in x:
        scores = F.softplus(row @ moe.gate.weight.t() / cfg.gate_temp).sqrt()
        ids = torch.sort(scores + moe.gate.bias, descending=True, stable=True).indices[:k]
        w = scores[ids] / (scores[ids].sum() + 1e-20) * cfg.routed_scaling_factor
        y = expert(moe.shared_experts, row, 1.0)
        for j in range(k):
            y = y + expert(moe.experts[int(ids[j])], row, float(w[j]))
        out.append(y)
    return torch.stack(out)


def test_moe_matches_the_spec_formula_in_float64() -> None:
    moe = _moe(torch.float64, act=True)
    x = torch.randn(13, moe.gate.cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ids = torch.zeros(13, dtype=torch.long)
    with torch.no_grad():
        got, want = moe(x, ids), _spec_moe(moe, x)
    # observed max |diff| 0.0; values are O(10), so 1e-13 only allows float64 reassociation
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)


def _loop(moe: MoE, x: torch.Tensor, ids_in: torch.Tensor) -> torch.Tensor:
    """The replaced code path: each expert called once on all its slots' rows, in slot order."""
    t, k = x.shape[0], moe.gate.cfg.num_experts_per_tok
    weights, ids = moe.gate(x, ids_in)
    flat, flat_w = ids.flatten(), weights.flatten()
    slots = torch.zeros(t * k, x.shape[1], dtype=x.dtype)
    for e, expert in enumerate(moe.experts):
        sel = torch.nonzero(flat == e).squeeze(1)
        if sel.numel():
            slots[sel] = expert(x[sel // k], flat_w[sel])
    return (wide(slots.view(t, k, -1)).sum(dim=1) + wide(moe.shared_experts(x))).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("act", [False, True], ids=["plain", "fp8"])
@pytest.mark.parametrize("t", [1, 8, 200])
def test_batched_experts_are_bitwise_the_per_expert_calls(dtype: torch.dtype, act: bool, t: int) -> None:
    moe = _moe(dtype, act)
    x = torch.randn(t, moe.gate.cfg.hidden_size, generator=torch.Generator().manual_seed(t)).to(dtype)
    with torch.inference_mode():
        assert torch.equal(moe(x, torch.zeros(t, dtype=torch.long)), _loop(moe, x, torch.zeros(t, dtype=torch.long)))


def test_expert_parallel_halves_sum_to_the_whole_layer() -> None:
    full = _moe(torch.float64, act=True)
    x = torch.randn(9, full.gate.cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ids = torch.zeros(9, dtype=torch.long)
    n = len(full.experts)
    parts = []
    for lo, hi in ((0, n // 2), (n // 2, n)):
        part = _moe(torch.float64, act=True)
        part.experts = torch.nn.ModuleList(list(part.experts)[lo:hi])
        part.expert_offset = lo
        parts.append(part)
    with torch.no_grad():
        routed = [None, None]
        for i, part in enumerate(parts):
            part.reduce = lambda r, i=i: routed.__setitem__(i, r) or r
            part(x, ids)
        shared = wide(full.shared_experts(x))
        # observed max |diff| 0.0; 1e-14 allows the halves' sums to add in another order
        torch.testing.assert_close(routed[0] + routed[1] + shared, full(x, ids), rtol=0, atol=1e-14)
