"""Topology: roles and source maps (spec/model.md §2), plus random valid / invalid V4.1 configs.

`v41_configs()` / `BASE_V41` are imported by test_layout.py.
"""

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare.cache.regions import CacheWriteError, RegionMap
from kvshare.config import ModelConfig, load_config
from kvshare.errors import ConfigError
from kvshare.topology import Role, Topology

BASE_V41: dict[str, Any] = {
    "model_type": "deepseek_v41", "vocab_size": 64, "hidden_size": 16, "num_attention_heads": 2, "head_dim": 16,
    "qk_rope_head_dim": 8, "q_lora_rank": 8, "o_groups": 1, "o_lora_rank": 8, "sliding_window": 8,
    "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4, "moe_intermediate_size": 16,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "rms_norm_eps": 1e-20,
}


@st.composite
def v41_configs(draw: Any) -> dict[str, Any]:
    """A random valid V4.1 config dict: ratio runs, each starting at a kv source, extra sources."""
    n = draw(st.integers(1, 24))
    ratios, kv, idx = [], [], []
    cur = None  # ratio of the latest kv source
    for layer in range(n):
        r = draw(st.sampled_from([0, 1, 2]))
        ratios.append(r)
        if r == 0:
            continue
        if cur != r or draw(st.integers(0, 4)) == 0:
            kv.append(layer)
            idx.append(layer)
            cur = r
        elif draw(st.integers(0, 2)) == 0:
            idx.append(layer)
    n_draft = draw(st.integers(0, 3))
    cand = -1
    if idx and draw(st.booleans()):
        # a candidate source whose later index sources all share its ratio
        ok = [s for s in idx if all(ratios[t] == ratios[s] for t in idx if t > s)]
        cand = draw(st.sampled_from(ok))
    return {**BASE_V41, "num_hidden_layers": n, "compress_ratios": ratios + [0] * n_draft,
            "num_nextn_predict_layers": n_draft, "kv_source_layer_ids": kv, "index_source_layer_ids": idx,
            "candidate_source_layer_id": cand, "candidate_topk_blocks": 4, "candidate_block_size": 2}


def build(d: dict[str, Any], share: bool = True) -> Topology:
    return Topology(ModelConfig.from_dict(d), share_cache=share)


# ---- V4.1-Flash, the table of spec/model.md §2.3 -----------------------------------------------------

FLASH_REINDEX = (24, 28, 32, 36)


def _flash_expected(layer: int) -> tuple[Role, int | None, int | None, int | None, str]:
    """(role, kv source, index source, index-K source, candidates) per model.md §2.3."""
    if layer < 2 or layer >= 40:
        return Role.SWA, None, None, None, "-"
    if layer < 20:
        own = 2 + 6 * ((layer - 2) // 6)
        return (Role.FULL, own, own, own, "-") if layer == own else (Role.REUSE, own, own, None, "-")
    if layer == 20:
        return Role.FULL, 20, 20, 20, "publishes"
    idx = max([20] + [s for s in FLASH_REINDEX if s <= layer])
    if layer in FLASH_REINDEX:
        return Role.REINDEX, 20, layer, 20, "consumes"
    return Role.REUSE, 20, idx, None, "-"


def test_v41_flash_role_table() -> None:
    topo = Topology(load_config("deepseek-v4.1-flash"))
    assert len(topo) == 43 and topo.num_layers == 40
    for p in topo.layers:
        role, kv, idx, ik, cand = _flash_expected(p.layer)
        got_cand = "publishes" if p.publishes_candidates else ("consumes" if p.uses_candidates else "-")
        assert (p.role, p.kv_source, p.index_source, p.index_k_source, got_cand) == (role, kv, idx, ik, cand), p
        assert p.needs_compressor_state == (p.layer in (2, 8, 14)), p.layer
        assert not p.needs_indexer_state
        assert p.is_draft == (p.layer >= 40)
        assert p.candidate_source == (20 if cand == "consumes" else None)
    assert topo.summary_counts() == {"swa": 2, "full": 4, "reindex": 4, "reuse": 30}
    rm = RegionMap(topo)
    assert rm.kv_owners == (2, 8, 14, 20) == rm.index_owners
    assert rm.reads("kv", 26) == 20 and rm.reads("index_k", 24) == 20 and rm.reads("kv", 13) == 8
    assert rm.readers("kv", 2) == (2, 3, 4, 5, 6, 7)
    assert rm.readers("index_k", 20) == (20, 24, 28, 32, 36)
    assert rm.writes("kv", 20) == (20,) and rm.writes("index_k", 8) == (8,)
    with pytest.raises(KeyError):
        rm.reads("kv", 0)
    with pytest.raises(KeyError):
        rm.reads("index_k", 25)  # a Reuse layer reads no index keys
    with pytest.raises(CacheWriteError, match="layer 26 .*written by layer 20"):
        rm.writes("kv", 26)


def test_unshared_region_map_owns_everything_compressed() -> None:
    topo = Topology(load_config("deepseek-v4.1-flash"), share_cache=False)
    rm = RegionMap(topo, share_cache=False)
    assert rm.kv_owners == tuple(range(2, 40)) == rm.index_owners
    assert rm.reads("kv", 26) == 26 and rm.reads("index_k", 24) == 24
    assert rm.writes("kv", 2) == (2, 3, 4, 5, 6, 7)  # the source writes every copy of its rows
    # index copies: every layer whose index source scores layer 20's keys (20..39)
    assert rm.writes("index_k", 20) == tuple(range(20, 40))
    with pytest.raises(CacheWriteError):
        rm.writes("kv", 3)  # a Reuse layer owns a copy but computes nothing to write
    assert [p.role for p in topo.layers] == [p.role for p in Topology(topo.cfg).layers]  # math unchanged


def test_nemo_tiny_config_exercises_every_role() -> None:
    topo = Topology(load_config("tiny-v41"))
    roles = [p.role for p in topo.layers]
    assert roles == [Role.SWA, Role.SWA, Role.FULL, Role.REUSE, Role.FULL, Role.REINDEX]
    assert topo[5].index_k_source == 4 and topo[5].uses_candidates and topo[4].publishes_candidates
    assert topo[3].kv_source == 2 and topo[2].needs_compressor_state and not topo[4].needs_compressor_state


def test_v4_every_compressed_layer_is_its_own_source() -> None:
    topo = Topology(load_config("deepseek-v4-flash"))
    for p in topo.layers:
        if p.ratio == 0:
            assert p.role is Role.SWA
            continue
        assert (p.role, p.kv_source, p.needs_compressor_state) == (Role.FULL, p.layer, True)
        assert (p.index_source == p.layer) == (p.ratio == 4) == p.needs_indexer_state
    rm, un = RegionMap(topo), RegionMap(topo, share_cache=False)
    assert len(rm.kv_owners) == 41 and len(rm.index_owners) == 21
    assert (un.kv_owners, un.index_owners) == (rm.kv_owners, rm.index_owners)


@pytest.mark.parametrize("name", ["tiny-v41-deep", "deepseek-v4-pro", "tiny-v4"])
def test_other_shipped_topologies_resolve(name: str) -> None:
    topo = Topology(load_config(name))
    rm = RegionMap(topo)
    assert rm.kv_owners and set(rm.index_owners) <= set(rm.kv_owners)


# ---- properties ------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(v41_configs())
def test_source_rule_property(d: dict[str, Any]) -> None:
    topo = build(d)
    kv, idx = d["kv_source_layer_ids"], d["index_source_layer_ids"]
    for p in topo.layers:
        if p.ratio == 0:
            assert p.kv_source is None and p.index_source is None and p.role is Role.SWA
            continue
        assert p.kv_source == max(s for s in kv if s <= p.layer)
        assert p.index_source == max(s for s in idx if s <= p.layer)
        assert topo[p.kv_source].ratio == p.ratio
        if p.is_index_source:
            assert p.index_k_source == max(s for s in kv if s <= p.layer)
        else:
            assert p.index_k_source is None
        assert p.needs_compressor_state == (p.layer in kv and p.ratio == 2)
    _check_region_maps(topo, kv)


def _check_region_maps(topo: Topology, kv: list[int]) -> None:
    """Both cache modes: each region has exactly one writer, reads name owned regions."""
    for share in (True, False):
        rm = RegionMap(topo, share_cache=share)
        compressed = [p.layer for p in topo.layers if p.is_compressed]
        assert rm.kv_owners == (tuple(sorted(kv)) if share else tuple(compressed))
        for kind in ("kv", "index_k"):
            written = [o for lr in rm.layers for o in (lr.writes_kv if kind == "kv" else lr.writes_index)]
            assert sorted(written) == list(rm.owners(kind))  # every region written, by one layer only
        for p in topo.layers:
            lr = rm[p.layer]
            if p.is_compressed:
                assert lr.reads_kv == (p.kv_source if share else p.layer)
            if p.index_k_source is not None:
                assert lr.reads_index == (p.index_k_source if share else p.layer)
            assert bool(lr.writes_kv) == p.is_kv_source  # only the layer that computes rows writes
            assert bool(lr.writes_index) == p.is_index_k_source


def _mutations(d: dict[str, Any], data: Any) -> tuple[str, dict[str, Any]]:
    """One guaranteed-invalid edit of a valid config."""
    d = {k: (list(v) if isinstance(v, list) else v) for k, v in d.items()}
    n, kv, idx, ratios = d["num_hidden_layers"], d["kv_source_layer_ids"], d["index_source_layer_ids"], d["compress_ratios"]
    options = ["ratio3", "short", "oob", "neg", "dup_idx", "bad_type", "missing", "draft_ratio", "draft_source"]
    if kv:
        options += ["drop_first_kv", "kv_ratio0", "kv_not_idx", "dup_kv", "cand_budget"]
    non_idx = [layer for layer in range(n) if layer not in idx]
    if non_idx:
        options.append("cand_not_idx")
    flippable = [layer for layer in range(n) if ratios[layer] > 0 and layer not in kv]
    if flippable:
        options.append("ratio_flip")
    non_kv = [layer for layer in range(n) if layer not in kv]
    if kv and non_kv:
        options.append("ik_not_kv")
    m = data.draw(st.sampled_from(options))
    if m == "ratio3":
        ratios[data.draw(st.integers(0, n - 1))] = 3
    elif m == "short":
        d["compress_ratios"] = ratios[: n - 1]
    elif m == "oob":
        d["index_source_layer_ids"] = idx + [len(ratios) + data.draw(st.integers(0, 5))]
    elif m == "neg":
        d["kv_source_layer_ids"] = kv + [-1 - data.draw(st.integers(0, 3))]
    elif m == "dup_idx":
        d["index_source_layer_ids"] = idx + idx[:1] if idx else [0, 0]
    elif m == "bad_type":
        d["kv_source_layer_ids"] = kv + ["x"]
    elif m == "missing":
        del d[data.draw(st.sampled_from(["head_dim", "num_hidden_layers", "vocab_size", "sliding_window"]))]
    elif m == "draft_ratio":
        d["compress_ratios"] = ratios + [2]
        d["num_nextn_predict_layers"] = len(ratios) + 1 - n
    elif m == "draft_source":
        d["compress_ratios"] = ratios + [0]
        d["num_nextn_predict_layers"] = len(ratios) + 1 - n
        d["kv_source_layer_ids"] = kv + [len(ratios)]
    elif m == "drop_first_kv":
        d["kv_source_layer_ids"] = kv[1:]
    elif m == "kv_ratio0":
        ratios[data.draw(st.sampled_from(kv))] = 0
    elif m == "kv_not_idx":
        gone = data.draw(st.sampled_from(kv))
        d["index_source_layer_ids"] = [s for s in idx if s != gone]
    elif m == "dup_kv":
        d["kv_source_layer_ids"] = kv + kv[-1:]
    elif m == "cand_budget":
        d.update(candidate_source_layer_id=idx[0], candidate_topk_blocks=1, candidate_block_size=1, index_topk=4)
    elif m == "cand_not_idx":
        d["candidate_source_layer_id"] = data.draw(st.sampled_from(non_idx))
    elif m == "ratio_flip":
        layer = data.draw(st.sampled_from(flippable))
        ratios[layer] = 3 - ratios[layer]
    elif m == "ik_not_kv":
        d["index_k_source_layer_ids"] = kv + [data.draw(st.sampled_from(non_kv))]
    return m, d


@settings(max_examples=100, deadline=None)
@given(v41_configs(), st.data())
def test_invalid_configs_raise_config_error(d: dict[str, Any], data: Any) -> None:
    m, bad = _mutations(d, data)
    with pytest.raises(ConfigError) as e:
        build(bad)
    assert isinstance(e.value.field, str) and e.value.field, m
    assert e.value.layer is None or isinstance(e.value.layer, int), m
