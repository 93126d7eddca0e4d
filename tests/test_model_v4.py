"""DeepSeek-V4 path (tiny-v4: ratios 0/4/128/4/0/4, a hash-MoE layer): self-consistency across step
shapes, HCA visibility, and index keys from the indexer's own compressor. Parity with transformers'
DeepseekV4ForCausalLM is tested in test_hf_oracle.py (quant off)."""

from __future__ import annotations

import pytest
import torch

from kvshare.cache.dense import DenseCache
from kvshare.step import StepBatch
from test_model_common import (
    MAX_LEN, assert_close, make_model, run_chunks, token_ids,
)

pytestmark = pytest.mark.usefixtures("small_prefill_paths")  # prefill runs its fast paths


SEQ = 136  # the first ratio-128 entry becomes visible at t = 127


@pytest.mark.parametrize("quant", [False, True], ids=["plain", "quant"])
def test_v4_prefill_chunks_and_decode_agree(quant: bool) -> None:
    model = make_model("tiny-v4", quant).double()
    model.record_ties()
    ids = token_ids(model.cfg, SEQ)
    full = run_chunks(model, ids, [SEQ])
    # prefill, single tokens across the ratio-4 and ratio-128 group ends, then uneven chunks
    got = run_chunks(model, ids, [101, 1, 1, 1, 1, 1, 1, 13, 1, 1, 1, 1, 1, 11])
    assert_close(got, full, what="chunked/decoded vs prefill")
    assert not model.tie_log, f"exact top-k ties: {model.tie_log}"


def test_hca_entry_is_visible_exactly_from_its_last_token() -> None:
    model = make_model("tiny-v4")
    ids = token_ids(model.cfg, SEQ)
    base = run_chunks(model, ids, [SEQ])
    with torch.no_grad():
        w = model.layers[2].attn.compressor.wkv.weight  # (a pure rescale would be normalised away)
        w.add_(0.2 * torch.randn(w.shape, generator=torch.Generator().manual_seed(0)))
    moved = run_chunks(model, ids, [SEQ])
    assert torch.equal(base[:127], moved[:127])
    assert (base[127:] - moved[127:]).abs().amax() > 1e-3


def test_v4_index_keys_come_from_the_indexer_compressor() -> None:
    model = make_model("tiny-v4")
    ids = token_ids(model.cfg, 16)
    cache = DenseCache(model.cfg, model.topo, 1, MAX_LEN)
    run_chunks(model, ids, [16], cache=cache)
    csa = [1, 3, 5]
    assert {layer for kind, layer in cache.rows if kind == "index_k"} == set(csa)
    assert {layer for kind, layer in cache.rows if kind == "kv"} == {1, 2, 3, 5}
    for layer in csa:
        assert cache.rows[("index_k", layer)].shape[-1] == model.cfg.index_head_dim
        assert ("indexer_compressor", layer) in cache.rings and ("compressor", layer) in cache.rings
    assert cache.rings[("compressor", 1)].shape[1:] == (8, 4 * model.cfg.head_dim)  # 2 x 4 tokens, [kv | score]
    assert cache.rings[("compressor", 2)].shape[1:] == (128, 2 * model.cfg.head_dim)


def test_v4_batched_with_hash_layer_equals_alone() -> None:
    model = make_model("tiny-v4", True).double()
    a, b = token_ids(model.cfg, 40, seed=3), token_ids(model.cfg, 23, seed=4)
    alone_a, alone_b = run_chunks(model, a, [33, 7]), run_chunks(model, b, [20, 3])
    cache = DenseCache(model.cfg, model.topo, 2, MAX_LEN, dtype=torch.float64)
    with torch.no_grad():
        first = model(torch.cat([a[:33], b[:20]]), StepBatch.build([0, 0], [33, 20], [1, 0]), cache)
        second = model(torch.cat([a[33:], b[20:]]), StepBatch.build([33, 20], [7, 3], [1, 0]), cache)
    assert_close(torch.cat([first[:33], second[:7]]), alone_a, what="a")
    assert_close(torch.cat([first[33:], second[7:]]), alone_b, what="b")
