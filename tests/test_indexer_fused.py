"""The indexer's query side and top-k in one native call (`layers.index_select.IndexSelect.fused`,
kernels/attn_proj.index_select, csrc/attn_proj.cpp `index_query`).

Its picks must be those of `IndexSelect.native_scores` over the queries and head weights the torch code
projects (wq_b with its FP8 input rounding where the model has it, RoPE, weights_proj, the scale):
the spies below recompute that selection beside every fused call of paged, batched, chunked engine
runs and compare. The selection itself is tested against the spec's formula in
tests/test_native_index.py.

Mutations caught (run by hand): the RoPE tables of the main rotary embedding instead of the
compressed one (the three engine tests that take the fused call), the FP8 rounding of qr skipped
(the act-rounding test). Not caught, by nature: the head-weight scale dropped (a positive factor
on every score of a row leaves its top-k as it is, so the picks are the same).
"""

from __future__ import annotations


import pytest
import torch

from kvshare.config import load_config
from kvshare.engine.engine import LLMEngine
from kvshare.kernels import decode as native
from kvshare.layers import index_select
from kvshare.layers.index_select import IndexSelect
from kvshare.model import Transformer
from kvshare.model.quantize import QuantMode

from test_engine_exact import greedy_random_run

pytestmark = pytest.mark.skipif(not native.enabled(), reason="native kernels unavailable on this machine")


def _torch_picks(idx, ctx, x: torch.Tensor, qr: torch.Tensor) -> torch.Tensor:
    """The native selection over the torch projections (what the fused call replaces)."""
    return idx.native_scores(ctx, *idx.queries(ctx, x, qr))


def _run(dtype: torch.dtype, quant: QuantMode, monkeypatch: pytest.MonkeyPatch, **engine_args) -> list[bool]:
    """tiny-v4 (index_topk 4: every step past 16 tokens scores), three requests in a paged engine
    with chunked prefill; returns, per fused call, whether its picks equal the torch projections'."""
    model = Transformer(load_config("tiny-v4"), quant=quant).init_weights(3).eval().to(dtype)
    real = IndexSelect.fused
    same: list[bool] = []

    def spy(idx, ctx, x, qr):
        got = real(idx, ctx, x, qr)
        if got is not None:
            same.append(torch.equal(got, _torch_picks(idx, ctx, x, qr)))
        return got

    monkeypatch.setattr(IndexSelect, "fused", spy)
    eng = LLMEngine(model, batch_invariant=True, quantize=quant, dtype=str(dtype).split(".")[1],
                    block_size=128, num_blocks=10, max_num_seqs=3, max_num_batched_tokens=17, **engine_args)
    greedy_random_run(eng, model.cfg.vocab_size, (40, 9, 27), seed=8)
    return same


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_picks_equal_the_torch_projections_picks(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    same = _run(dtype, QuantMode(cache=False, index=False, act=False), monkeypatch)
    assert len(same) >= 30 and all(same)  # observed: 39 fused calls, every one equal


def test_fused_picks_with_fp8_input_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    """FP8 rounding of wq_b's input (the model's act quantisation) happens inside the call too."""
    same = _run(torch.bfloat16, QuantMode(cache=False, index=False, act=True), monkeypatch)
    assert len(same) >= 30 and all(same)  # observed: 39


def test_a_quantised_index_keeps_the_torch_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    """The V4 index quantiser (Hadamard + FP4) is not in the fused call: it does not serve there."""
    assert _run(torch.bfloat16, QuantMode(cache=False, index=True, act=False), monkeypatch) == []


def test_the_switch_and_a_hook_keep_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _run(torch.bfloat16, QuantMode(False, False, False), monkeypatch,
                kernel_overrides={"fused_attn_proj": False}) == []  # bound to forward_native: no fused call
    calls: list[int] = []
    real_build = index_select._build

    def build(idx):  # a forward hook on weights_proj, as tensor parallelism or a user may add
        idx.weights_proj.register_forward_hook(lambda *a: calls.append(1))
        return real_build(idx)

    monkeypatch.setattr(index_select, "_build", build)
    assert _run(torch.bfloat16, QuantMode(False, False, False), monkeypatch) == []
    assert calls  # the hooked weights_proj ran: the torch projections
