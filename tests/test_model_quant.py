"""Fake-quantisation switch (spec/model.md §6): stored rows are on the quantised grids, the switch
works at runtime, and gradients pass straight through (the training path)."""

from __future__ import annotations

import pytest
import torch

from kvshare.layers import KernelChoice
from kvshare.cache.dense import DenseCache
from kvshare.model import QuantMode
from kvshare.layers.linear import QLinear
from kvshare.model.quantize import fit_block
from kvshare.quant import fake_quant_fp4, fake_quant_fp8
from kvshare.step import StepBatch
from test_model_common import (
    MAX_LEN, make_model, run_chunks, token_ids,
)



def _prefill_cache(name: str, quant: bool, n: int = 20) -> tuple[DenseCache, torch.Tensor]:
    model = make_model(name, quant)
    cache = DenseCache(model.cfg, model.topo, 1, MAX_LEN)
    return cache, run_chunks(model, token_ids(model.cfg, n), [n], cache=cache)


def test_v41_stored_rows_are_on_the_quant_grids() -> None:
    cache, _ = _prefill_cache("cand", True)
    win = cache.rings[("window", 4)][0]
    assert torch.equal(fake_quant_fp8(win, 16), win), "window rows: FP8 e4m3, ue8m0 (block 32 fitted to 16)"
    kv = cache.rows[("kv", 4)][0, :20]
    assert torch.equal(fake_quant_fp4(kv, 16, "e4m3"), kv), "compressed rows: FP4, e4m3 scales, block 16"
    keys = cache.rows[("index_k", 1)][0, :10]
    assert torch.equal(fake_quant_fp4(keys, 16, "ue8m0"), keys), "index keys: FP4, ue8m0"
    plain, _ = _prefill_cache("cand", False)
    assert not torch.equal(fake_quant_fp4(plain.rows[("kv", 4)][0, :20], 16, "e4m3"), plain.rows[("kv", 4)][0, :20])


def test_v4_stored_rows_quantise_nope_dims_only() -> None:
    cache, _ = _prefill_cache("tiny-v4", True, n=24)
    rd = 8
    for row in (cache.rings[("window", 1)][0], cache.rows[("kv", 1)][0, :6]):
        nope, rope = row[..., :-rd], row[..., -rd:]
        assert torch.equal(fake_quant_fp8(nope, 8), nope)
        assert not torch.equal(fake_quant_fp8(rope, 8), rope), "rope dims stay unquantised"


def test_runtime_switch_equals_fresh_models() -> None:
    on, off = make_model("tiny-v41", True), make_model("tiny-v41", False)
    ids = token_ids(on.cfg, 16)
    a_on, a_off = run_chunks(on, ids, [16]), run_chunks(off, ids, [16])
    assert not torch.allclose(a_on, a_off, atol=1e-3)
    on.set_quant(False)
    assert torch.equal(run_chunks(on, ids, [16]), a_off)
    on.set_quant(QuantMode(cache=True, index=True, act=True))
    assert torch.equal(run_chunks(on, ids, [16]), a_on)
    on.set_quant(QuantMode(cache=False, index=False, act=True))
    partial = run_chunks(on, ids, [16])
    assert not torch.equal(partial, a_on) and not torch.equal(partial, a_off)


@pytest.mark.parametrize("name", ["cand", "tiny-v4"])
def test_gradients_flow_through_quantised_forward(name: str) -> None:
    model = make_model(name, True).train()
    model.bind(KernelChoice.reference())  # training: the autograd-capable torch reference
    ids = token_ids(model.cfg, 20)
    cache = DenseCache(model.cfg, model.topo, 1, MAX_LEN)
    logits = model(ids, StepBatch.build([0], [20]), cache)
    loss = torch.nn.functional.cross_entropy(logits[:-1], ids[1:])
    loss.backward()
    for name_, p in model.named_parameters():
        if p.grad is not None:
            assert torch.isfinite(p.grad).all(), name_
    grads = dict(model.named_parameters())
    for key in ("layers.1.attn.wq_a.weight", "layers.1.attn.compressor.wkv.weight", "layers.1.attn.attn_sink",
                "layers.2.hc_attn_fn", "embed.weight", "head.weight"):
        g = grads[key].grad
        assert g is not None and g.abs().sum() > 0, key


def test_act_quant_block_fits_narrow_inputs() -> None:
    assert fit_block(16, 32) == 16 and fit_block(64, 32) == 32 and fit_block(24, 32) == 8
    mode = QuantMode()
    lin = QLinear(16, 4, mode, 32)
    x = torch.randn(3, 16)
    assert torch.equal(lin(x), torch.nn.functional.linear(fake_quant_fp8(x, 16), lin.weight))
    mode.act = False
    assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight))
