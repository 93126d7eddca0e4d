"""Unshared cache mode (``share_kv_cache=False``) is a real engine without sharing.

Every compressed layer reads its own copy of the compressed KV and index keys (corrupting a Reuse
layer's copy after it was written changes the output; in shared mode that layer has no region at
all); pool bytes equal a byte count computed by hand from row sizes; only the layer that computes
rows may write them (negative control); greedy tokens equal shared mode's. Both backends (paged
and the dense reference) resolve regions through the same RegionMap.
"""

from __future__ import annotations

import pytest
import torch

from kvshare.cache.layout import CacheLayout
from kvshare.cache.paged_backend import PagedBackend
from kvshare.cache.pool import BlockPool
from kvshare.cache.regions import CacheWriteError
from kvshare.config import load_config
from kvshare.engine.engine import LLMEngine
from kvshare.engine.sampling import SamplingParams
from kvshare.cache.dense import DenseCache
from kvshare.model import Transformer
from kvshare.step import StepBatch
from kvshare.topology import Topology
from test_model_common import make_model, token_ids

SEQ, BS = 20, 8
TABLE = torch.tensor([[1, 2, 3]])  # 3 blocks of 8 positions cover the prompt and the decoded token


def _paged(model: Transformer, share: bool) -> tuple[BlockPool, PagedBackend]:
    lay = CacheLayout(model.topo, BS, kv_format="fp32", index_format="fp32", window_format="fp32",
                      share_cache=share)
    pool = BlockPool(lay, 4, 1)
    return pool, PagedBackend(pool)


def _prefill_then_decode(model, cache, ids, corrupt=None) -> torch.Tensor:
    """Logits of one decode step after a prefill; `corrupt()` runs between the two."""
    n = ids.numel() - 1
    kw = {"block_tables": TABLE} if isinstance(cache, PagedBackend) else {}
    with torch.no_grad():
        model(ids[:n], StepBatch.build([0], [n], [0], **kw), cache)
        if isinstance(cache, PagedBackend):
            cache.end_step()
        if corrupt is not None:
            corrupt()
        return model(ids[n:], StepBatch.build([n], [1], [0], **kw), cache)


@pytest.mark.parametrize("backend", ["paged", "dense"])
def test_corrupting_a_reuse_layers_own_copy_changes_the_output(backend: str) -> None:
    """Layer 3 (Reuse of kv source 1) and 7 (Reuse, index keys of 4): their copies are read."""
    model = make_model("cand").double()
    ids = token_ids(model.cfg, SEQ + 1)

    def run(share: bool, kind: str | None = None, layer: int | None = None) -> torch.Tensor:
        if backend == "paged":
            pool, cache = _paged(model, share)
        else:
            cache = DenseCache(model.cfg, model.topo, 1, 32, dtype=torch.float64, share_cache=share)

        def corrupt() -> None:
            views = pool.owner_views() if backend == "paged" else cache.rows
            views[(kind, layer)].fill_(64 if backend == "paged" else 3.0)  # byte 64 x 4 = fp32 3.0

        return _prefill_then_decode(model, cache, ids, corrupt if kind is not None else None)

    clean_shared, clean = run(True), run(False)
    assert torch.equal(clean, clean_shared)  # identical maths, different regions (float64, 0 observed)
    for kind, layer in (("kv", 3), ("kv", 7), ("index_k", 2), ("index_k", 6)):
        bad = run(False, kind, layer)
        assert (bad - clean).abs().max() > 1e-3, f"layer {layer}'s own {kind} copy is never read"
    # The Reuse layers' index copies (3, 5, 7) hold keys no query scores: corrupting them is harmless.
    assert torch.equal(run(False, "index_k", 3), clean)
    # Shared mode: a Reuse layer owns no region at all.
    with pytest.raises(KeyError):
        run(True, "kv", 3)


def test_only_the_computing_layer_writes_negative_control() -> None:
    """spec/cache.md §9.3: a write from a layer that writes no region raises, in both modes and backends."""
    model = make_model("cand")
    b = StepBatch.build([0], [4], [0], block_tables=TABLE)
    seq, j, v = torch.tensor([0]), torch.tensor([0]), torch.ones(1, model.cfg.head_dim)
    for share in (True, False):
        _, paged = _paged(model, share)
        dense = DenseCache(model.cfg, model.topo, 1, 32, share_cache=share)
        for cache in (paged, dense):
            cache.write_rows("kv", 1, seq, j, v, b)  # positive control: the kv source writes
            cache.write_rows("index_k", 4, seq, j, v, b)
            for kind, layer in (("kv", 3), ("kv", 2), ("index_k", 2), ("index_k", 7), ("kv", 0)):
                with pytest.raises(CacheWriteError, match=f"layer {layer} "):
                    cache.write_rows(kind, layer, seq, j, v, b)


def test_unshared_pool_bytes_equal_a_hand_count_after_a_forward() -> None:
    """tiny-v41, fp32 rows (16 values x 4 B = 64 B), block 8, layers 2,3 ratio 2 and 4,5 ratio 1.

    Unshared: every compressed layer holds kv + index keys: 2 x (4+4 rows) + 2 x (8+8 rows) = 48
    rows x 64 B = 3,072 B per block (shared: owners 2 and 4 only, 24 rows = 1,536 B). Per slot:
    6 window rings of 8 rows x 64 B = 3,072 B plus layer 2's compressor (kv, score) ring of 2 rows
    x 16 fp32 = 2 x 128 B = 256 B.
    """
    model = make_model("tiny-v41")
    blocks, slots = 12, 3
    eng = LLMEngine(model, block_size=8, num_blocks=blocks, max_num_seqs=slots, share_kv_cache=False,
                    max_num_batched_tokens=64)
    shared = LLMEngine(model, block_size=8, num_blocks=blocks, max_num_seqs=slots, max_num_batched_tokens=64)
    assert shared.pool.block_bytes == blocks * 1536
    assert eng.layout.bytes_per_block == shared.layout.unshared_layout.bytes_per_block == 3072
    before = (eng.pool.block_bytes, eng.pool.ring_bytes)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    for i in range(slots):
        eng.add_request(str(i), list(range(1 + i, 12 + 3 * i)), params)
        shared.add_request(str(i), list(range(1 + i, 12 + 3 * i)), params)
    out, ref = {}, {}
    while eng.has_unfinished_requests() or shared.has_unfinished_requests():
        out.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
        ref.update({o.request_id: o.token_ids for o in shared.step() if o.finished})
    assert out == ref and len(out) == slots
    assert (eng.pool.block_bytes, eng.pool.ring_bytes) == before == (blocks * 3072, slots * (3072 + 256))
    assert eng.pool.ring_bytes == slots * eng.layout.state_bytes_per_seq


def test_v41_flash_unshared_layout_counts_every_compressed_layer() -> None:
    """Independent of the carve: 38 compressed layers x (288 + 68) B x entries per token (½ or 1)."""
    lay = CacheLayout(Topology(load_config("deepseek-v4.1-flash")), 128, share_cache=False)
    ratios = load_config("deepseek-v4.1-flash").compress_ratios[:40]
    per_token = sum((288 + 68) / r for r in ratios if r)
    assert lay.bytes_per_token == per_token == 10_324
