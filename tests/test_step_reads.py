"""Paged reads: index keys / compressed rows gathered by whole blocks equal the per-row address
gather bit for bit, and a step reuses a region's rows for every layer that reads it (sharing on),
while with sharing off every layer reads its own copy (no reuse)."""

from __future__ import annotations

import pytest
import torch

from kvshare.engine.engine import LLMEngine
from kvshare.engine.sampling import SamplingParams
from test_model_common import make_model, token_ids


def _engine(share: bool, name: str = "tiny-v41-deep", **kw) -> LLMEngine:
    model = make_model(name)
    # the batched read paths (prefix reads of whole blocks); a batch-invariant engine reads per row
    kw.setdefault("batch_invariant", False)
    return LLMEngine(model, max_num_seqs=2, num_blocks=16, max_model_len=192, max_num_batched_tokens=256,
                     share_kv_cache=share, **kw)


def _spy_prefix(eng: LLMEngine) -> list[tuple]:
    calls: list[tuple] = []
    orig = eng.backend.gather_prefix

    def spy(kind, layer, n_rows, batch):
        rows, mask = orig(kind, layer, n_rows, batch)
        calls.append((kind, layer, n_rows.clone(), batch, rows.clone(), mask.clone()))
        return rows, mask

    eng.backend.gather_prefix = spy
    return calls


@pytest.mark.parametrize("name,kinds", [("tiny-v41-deep", {"index_k"}), ("tiny-v4", {"kv", "index_k"})])
def test_block_gather_equals_the_row_address_gather(name: str, kinds: set[str]) -> None:
    eng = _engine(True, name)
    calls = _spy_prefix(eng)
    for i, n in enumerate((150, 77)):  # two sequences, several blocks each, partial last blocks
        eng.add_request(str(i), token_ids(eng.cfg, n, seed=i).tolist(), SamplingParams(max_tokens=1))
    eng.step()  # one prefill step: every region is written before it is read, nothing after
    assert {c[0] for c in calls} == kinds  # V4 HCA layers read every compressed row
    eng.backend._reads.clear()
    for kind, layer, n_rows, batch, rows, mask in calls:
        width = rows.shape[1]
        j = torch.arange(width)[None, :].expand(n_rows.numel(), width)
        j = torch.where(j < n_rows[:, None], j, torch.full_like(j, -1))
        ref = eng.backend.gather_rows(kind, layer, torch.arange(n_rows.numel()), j, batch)
        assert torch.equal(rows, ref), (kind, layer)
        assert torch.equal(mask, j >= 0)
        eng.backend._reads.clear()


@pytest.mark.parametrize("share", [True, False])
def test_reads_are_reused_only_when_layers_share_a_region(share: bool) -> None:
    eng = _engine(share)
    eng.add_request("a", token_ids(eng.cfg, 40).tolist(), SamplingParams(max_tokens=4))
    while eng.has_unfinished_requests():
        eng.step()
    reads = eng.backend._reads
    assert reads.misses > 0
    assert (reads.hits > 0) == share


def test_every_backend_declares_the_in_place_reads() -> None:
    """The `CacheBackend` protocol's in-place reads (`window_keys`, `pool_keys`) are methods of every
    backend, so a reader asks the backend it is handed instead of probing it; the dense cache offers
    none (None), the paged backend the plain rows of a bf16 / fp32 pool. Mutation caught: DenseCache
    without `pool_keys` (the attribute check fails)."""
    from kvshare.cache.paged_backend import PagedBackend
    from kvshare.cache.dense import DenseCache
    from kvshare.step import CacheBackend, StepBatch

    methods = [n for n, v in vars(CacheBackend).items() if callable(v) and not n.startswith("_")]
    assert {"window_keys", "pool_keys", "history", "gather_prefix"} <= set(methods)
    for backend in (DenseCache, PagedBackend):
        missing = [n for n in methods if not callable(getattr(backend, n, None))]
        assert not missing, (backend.__name__, missing)
    model = make_model("tiny-v41")
    dense = DenseCache(model.cfg, model.topo, 1, 64)
    batch = StepBatch.build([0], [4])
    assert dense.window_keys("window", 0, torch.zeros(4, model.cfg.head_dim), 8, batch) is None
    assert dense.pool_keys("kv", 1, torch.float32, batch) is None


@pytest.mark.parametrize("share", [True, False])
def test_batch_invariant_decode_reuses_the_sources_gathered_rows(share: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch-invariant engine over FP8 / FP4 cache rows whose attention gathers (the in-place
    reads off: the torch attention, or a backend without them) gathers each decode row's picks
    (`PagedAttention._picked`); a Reuse layer asks with its source's picks and the step's sequence
    index, so with sharing on it gets the rows its source gathered (one gather per region and
    step), with sharing off none. Mutation caught (sharing on): the sequence index expanded per
    call (``seq.unsqueeze(1).expand_as(picks)``: a new tensor each layer, no hit)."""
    from kvshare.layers.attention import PagedAttention

    monkeypatch.setattr(PagedAttention, "in_place", lambda self, *a: None)
    eng = _engine(share, batch_invariant=True, quantize=True)
    eng.add_request("a", token_ids(eng.cfg, 40).tolist(), SamplingParams(max_tokens=4))
    eng.step()  # the prefill
    reads, seen = eng.backend._reads, []
    get = reads.get

    def spy(view, kind, key, aux):
        hit = get(view, kind, key, aux)
        seen.append((kind, hit is not None))
        return hit

    reads.get = spy
    while eng.has_unfinished_requests():
        eng.step()
    rows = [hit for kind, hit in seen if kind == "rows"]
    assert rows and (sum(rows) > 0) == share, seen
