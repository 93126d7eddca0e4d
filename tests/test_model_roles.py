"""V4.1 role wiring on the `cand` test model (see test_model_common): who reads what, and when.

A recording proxy around DenseCache logs every cache call in order; compressed layers read their
compressed rows once per step, in layer order, which maps each `gather_rows("kv")` to its layer.
"""

from __future__ import annotations

from typing import Any

import torch

from kvshare.cache.dense import DenseCache
from kvshare.step import StepBatch, StepState
from kvshare.topology import Role
from test_model_common import (
    MAX_LEN, assert_close, cand_config, make_model, run_chunks, token_ids,
)


SEQ = 24


class RecordingCache:
    """CacheBackend proxy: forwards to a DenseCache and logs (method, kind/name, layer, args)."""

    def __init__(self, inner: DenseCache) -> None:
        self.inner = inner
        self.log: list[tuple[str, str, int, dict[str, Any]]] = []

    def history(self, name, layer, values, depth, batch, rows=None):
        self.log.append(("history", name, layer, {"depth": depth}))
        return self.inner.history(name, layer, values, depth, batch, rows)

    def remember(self, name, layer, values, depth, batch):
        self.log.append(("remember", name, layer, {"depth": depth}))
        return self.inner.remember(name, layer, values, depth, batch)

    def write_rows(self, kind, layer, seq, index, values, batch):
        self.log.append(("write_rows", kind, layer, {"index": index.clone()}))
        return self.inner.write_rows(kind, layer, seq, index, values, batch)

    def gather_rows(self, kind, layer, seq, index, batch):
        self.log.append(("gather_rows", kind, layer, {"index": index.clone()}))
        return self.inner.gather_rows(kind, layer, seq, index, batch)

    def gather_prefix(self, kind, layer, n_rows, batch):
        self.log.append(("gather_prefix", kind, layer, {"n_rows": n_rows.clone()}))
        return self.inner.gather_prefix(kind, layer, n_rows, batch)

    def window_keys(self, name, layer, values, depth, batch, decode=False):
        return self.inner.window_keys(name, layer, values, depth, batch)

    def pool_keys(self, kind, layer, dtype, batch, decode=False):
        return self.inner.pool_keys(kind, layer, dtype, batch)

    def calls(self, method: str, kind: str) -> list[tuple[int, dict[str, Any]]]:
        return [(layer, a) for m, k, layer, a in self.log if m == method and k == kind]


def prefill_recorded(model, ids):
    cache = RecordingCache(DenseCache(model.cfg, model.topo, 1, MAX_LEN, dtype=model.embed.weight.dtype))
    state = StepState()
    with torch.no_grad():
        logits = model(ids, StepBatch.build([0], [ids.numel()]), cache, state)
    return cache, state, logits


def test_every_layer_reads_its_sources_picks_from_its_kv_source() -> None:
    model = make_model("cand")
    topo = model.topo
    cache, state, _ = prefill_recorded(model, token_ids(model.cfg, SEQ))
    compressed = [p.layer for p in topo.layers[: topo.num_layers] if p.ratio > 0]
    reads = cache.calls("gather_rows", "kv")
    assert len(reads) == len(compressed)
    assert set(state.topk) == {p.layer for p in topo.layers if p.is_index_source}
    for layer, (asked, args) in zip(compressed, reads):
        plan = topo[layer]
        # The model asks by its own layer id; the cache resolves the region (the kv source's, shared).
        assert asked == layer and cache.inner.regions.reads("kv", layer) == plan.kv_source
        assert torch.equal(args["index"], state.topk[plan.index_source]), f"layer {layer} ({plan.role})"
    reuse = [p.layer for p in topo.layers if p.role == Role.REUSE]
    assert reuse == [3, 5, 7]
    # Only owners write compressed rows or index keys; Reuse/Reindex layers write nothing shared.
    assert {layer for layer, _ in cache.calls("write_rows", "kv")} == {1, 4}
    assert {layer for layer, _ in cache.calls("write_rows", "index_k")} == {1, 4}


def test_reindex_reads_owner_keys_on_incomplete_group_steps() -> None:
    """Decode at an even position: the ratio-2 owner (1) writes no key, Reindex layer 2 still reads 1's."""
    model = make_model("cand").double()
    ids = token_ids(model.cfg, SEQ + 1)
    _, full_state, full = prefill_recorded(model, ids)
    t = 20  # even: group (20, 21) is incomplete
    inner = DenseCache(model.cfg, model.topo, 1, MAX_LEN, dtype=torch.float64)
    run_chunks(model, ids[:t], [t], cache=inner)
    cache, state = RecordingCache(inner), StepState()
    with torch.no_grad():
        out = model(ids[t:t + 1], StepBatch.build([t], [1]), cache, state)
    assert {layer for layer, _ in cache.calls("write_rows", "index_k")} == {4}
    asked = [layer for layer, _ in cache.calls("gather_prefix", "index_k")]
    assert asked == [1, 2, 4, 6]  # every index source asks by its own id; the cache resolves the owner
    assert [inner.regions.reads("index_k", layer) for layer in asked] == [1, 1, 4, 4]
    for src in (1, 2, 4, 6):
        assert torch.equal(state.topk[src][0], full_state.topk[src][t]), f"index source {src}"
    assert_close(out, full[t:t + 1], what="decode at even position")


def test_entry_created_this_step_is_written_before_read() -> None:
    """Ratio 1: at decode step t, owner 4 writes entry t before any layer reads compressed rows of 4."""
    model = make_model("cand")
    ids = token_ids(model.cfg, SEQ)
    t = 17
    inner = DenseCache(model.cfg, model.topo, 1, MAX_LEN)
    run_chunks(model, ids[:t], [t], cache=inner)
    cache = RecordingCache(inner)
    with torch.no_grad():
        model(ids[t:t + 1], StepBatch.build([t], [1]), cache)
    order = [(m, k, layer) for m, k, layer, _ in cache.log if m in ("write_rows", "gather_rows") and layer == 4]
    assert order[0] == ("write_rows", "index_k", 4) and order[1] == ("write_rows", "kv", 4)
    writes = cache.calls("write_rows", "kv")
    assert [int(a["index"][0]) for layer, a in writes if layer == 4] == [t]
    assert [int(a["index"][0]) for layer, a in writes if layer == 1] == [(t - 1) // 2]  # t odd: group done


def test_picks_are_causal_sorted_and_include_fresh_entries() -> None:
    model = make_model("cand")
    _, state, _ = prefill_recorded(model, token_ids(model.cfg, SEQ))
    pos = torch.arange(SEQ)
    own_entry_picked = False
    for src, picks in state.topk.items():
        ratio = model.topo[src].ratio
        limit = (pos + 1) // ratio
        valid = picks >= 0
        assert (picks[valid] < limit.unsqueeze(1).expand_as(picks)[valid]).all(), f"layer {src} sees the future"
        key = torch.where(valid, picks, torch.full_like(picks, 10**9))
        assert torch.equal(key, key.sort(dim=1).values), "picks sorted ascending, -1 last"
        reachable = torch.clamp(limit, max=model.cfg.index_topk)
        assert torch.equal(valid.sum(1), reachable), "every row picks min(k, reachable) entries"
        if ratio == 1:
            own_entry_picked |= bool((picks == pos.unsqueeze(1)).any())
    assert own_entry_picked, "some ratio-1 row picks the entry of its own token"


def test_future_tokens_do_not_change_past_logits() -> None:
    model = make_model("cand")
    a = token_ids(model.cfg, SEQ, seed=1)
    b = a.clone()
    b[15:] = token_ids(model.cfg, SEQ - 15, seed=2)
    la, lb = run_chunks(model, a, [SEQ]), run_chunks(model, b, [SEQ])
    assert torch.equal(la[:15], lb[:15])
    assert not torch.allclose(la[15:], lb[15:])


def test_candidate_mask_restricts_later_index_sources() -> None:
    cfg = cand_config()
    model = make_model("cand")
    _, state, _ = prefill_recorded(model, token_ids(cfg, SEQ))
    mask = state.candidates_of(4, 6)
    pos = torch.arange(SEQ)
    reachable = torch.arange(mask.shape[1]).unsqueeze(0) < (pos + 1).unsqueeze(1)
    excluded = reachable & ~mask
    pool = cfg.candidate_topk_blocks * cfg.candidate_block_size
    assert excluded[pool:].any(1).all(), "beyond the pool size every row excludes reachable entries"
    assert not excluded[:pool].any(), "while everything fits, nothing is excluded"
    newest = pos // cfg.candidate_block_size
    block_pinned = mask[pos, newest * cfg.candidate_block_size]
    assert block_pinned.all(), "the newest block is always a candidate"
    picks = state.topk[6]
    ok = picks >= 0
    rows = pos.unsqueeze(1).expand_as(picks)
    assert mask[rows[ok], picks[ok]].all(), "consumer picks stay inside the pool"
    src = state.topk[4]
    assert not mask[rows[src >= 0], src[src >= 0]].all(), "the source's own top-k is unrestricted"


def test_ties_are_detected_and_broken_toward_lower_positions() -> None:
    model = make_model("cand")
    model.layers[1].attn.indexer.weights_proj.weight.data.zero_()  # every score of layer 1 is 0
    model.record_ties()
    _, state, _ = prefill_recorded(model, token_ids(model.cfg, SEQ))
    k = model.cfg.index_topk
    assert any(layer == 1 and kind == "index" for layer, kind, _ in model.tie_log)
    picks = state.topk[1]
    late = picks[-1]
    assert late.tolist() == list(range(k)), "all-equal scores pick the lowest positions"
    model.record_ties(False)
    assert model.tie_log is None
