"""CacheLayout against the worked numbers of spec/cache.md §3-§4, plus layout properties."""

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_topology import build, v41_configs

from kvshare.cache.formats import row_format
from kvshare.cache.layout import NULL_BLOCKS, CacheLayout
from kvshare.config import load_config
from kvshare.errors import ConfigError
from kvshare.topology import Topology


@pytest.fixture(scope="module")
def flash() -> Topology:
    return Topology(load_config("deepseek-v4.1-flash"))


def test_v41_flash_fp4_block_layout(flash: Topology) -> None:
    lay = CacheLayout(flash)
    assert (lay.kv_format.row_bytes, lay.index_format.row_bytes, lay.window_format.row_bytes) == (288, 68, 528)
    got = [(r.owner, r.kind, r.offset, r.end, r.rows) for r in lay.regions]
    assert got == [
        (2, "index_k", 0, 4352, 64), (2, "kv", 4352, 22784, 64),
        (8, "index_k", 22784, 27136, 64), (8, "kv", 27136, 45568, 64),
        (14, "index_k", 45568, 49920, 64), (14, "kv", 49920, 68352, 64),
        (20, "index_k", 68352, 77056, 128), (20, "kv", 77056, 113920, 128),
    ]
    assert lay.bytes_per_block == 113_920 and lay.bytes_per_token == 890
    assert lay.owners == (2, 8, 14, 20)
    un = lay.unshared()
    assert un.bytes_per_token == 10_324 and un.share_cache is False
    assert lay.saving_factor == pytest.approx(11.6, abs=1e-12)


@pytest.mark.parametrize("kv,ik,shared,unshared,b128,b256", [
    ("fp4", "fp4", 890, 10_324, 113_920, 227_840),
    ("fp4", "fp8", 1_050, 12_180, 134_400, 268_800),
    ("fp8_v4", "fp8", 1_790, 20_764, 229_120, 458_240),
    ("fp8_v4", "fp4", 1_630, 18_908, 208_640, 417_280),
    ("bf16", "bf16", 3_200, 37_120, 409_600, 819_200),
])
def test_format_sweep(flash: Topology, kv: str, ik: str, shared: int, unshared: int, b128: int, b256: int) -> None:
    lay = CacheLayout(flash, kv_format=kv, index_format=ik)
    assert (lay.bytes_per_token, lay.unshared().bytes_per_token, lay.bytes_per_block) == (shared, unshared, b128)
    assert CacheLayout(flash, 256, kv_format=kv, index_format=ik).bytes_per_block == b256
    assert lay.saving_factor == pytest.approx(11.6, abs=1e-12)


def test_v4_flash_584_plus_68() -> None:
    topo = Topology(load_config("deepseek-v4-flash"))
    lay = CacheLayout(topo)
    assert (lay.kv_format.row_bytes, lay.index_format.row_bytes, lay.window_format.row_bytes) == (584, 68, 584)
    assert lay.payload_bytes_per_token == 3514.25  # 21 x (584 + 68) / 4 + 20 x 584 / 128
    # at block 128 a ratio-128 region is one 584-B row, padded to 608 B: 4 B/token of padding
    assert lay.bytes_per_token == 3518
    assert CacheLayout(topo, 512).bytes_per_token == 3514.25
    assert CacheLayout(topo, 128, alignment=8).bytes_per_token == 3514.25
    assert [r.kind for r in lay.regions if r.owner == 3] == ["kv"]  # ratio 128: no index K
    csa = CacheLayout(topo).states
    comp = {(s.layer, s.name): s for s in csa}
    assert (comp[(2, "compressor")].rows, comp[(2, "compressor")].width) == (8, 1024)  # coff 2, ratio 4
    assert comp[(2, "compressor")].nbytes == 2 * 8 * 1024 * 4
    assert (comp[(2, "indexer_compressor")].rows, comp[(2, "indexer_compressor")].width) == (8, 256)
    assert (comp[(3, "compressor")].rows, comp[(3, "compressor")].width) == (128, 512)
    assert (3, "indexer_compressor") not in comp
    assert lay.unshared().bytes_per_block == lay.bytes_per_block  # V4 has nothing to share


def test_per_sequence_state(flash: Topology) -> None:
    lay = CacheLayout(flash)
    assert lay.state_bytes("window", backbone_only=True) == 40 * 128 * 528 == 2_703_360
    assert lay.window_bytes_per_seq == 43 * 128 * 528  # DSpark draft layers keep a ring too
    comp = [s for s in lay.states if s.name == "compressor"]
    assert [s.layer for s in comp] == [2, 8, 14]
    assert all(s.nbytes == 2 * 2 * 512 * 4 == 8192 for s in comp)  # 2 x (512 + 512) x 4
    assert lay.compressor_bytes_per_seq == 24 * 1024
    assert lay.state_bytes_per_seq == lay.window_bytes_per_seq + 24 * 1024
    assert CacheLayout(flash, window_format="fp8_v4").state_bytes("window", backbone_only=True) == 40 * 128 * 584
    slack = CacheLayout(flash, window_slack=5, state_slack=5)
    # Speculation: backbone rings get one slack row per draft; the DSpark windows only ever hold
    # committed context (kvshare never writes the draft block), so they stay at W rows.
    assert slack.window_bytes_per_seq == 40 * 133 * 528 + 3 * 128 * 528
    assert slack.compressor_bytes_per_seq == 3 * 2 * (2 + 5) * 512 * 4


def test_padding_at_tiny_block(flash: Topology) -> None:
    lay = CacheLayout(flash, block_size=4)
    r = lay.region(2, "index_k")
    assert (r.rows, r.nbytes, r.nbytes_padded) == (2, 136, 160)
    assert lay.region(2, "kv").offset == 160
    assert CacheLayout(flash, block_size=4, alignment=1).region(2, "kv").offset == 136


@pytest.mark.parametrize("name,block,layer", [("deepseek-v4.1-flash", 127, 2), ("deepseek-v4-flash", 64, 3),
                                              ("deepseek-v4-flash", 6, 2), ("tiny-v41", 5, 2)])
def test_block_size_must_be_a_multiple_of_every_ratio(name: str, block: int, layer: int) -> None:
    with pytest.raises(ConfigError) as e:
        CacheLayout(Topology(load_config(name)), block_size=block)
    assert (e.value.field, e.value.layer) == ("block_size", layer)


@pytest.mark.parametrize("kw,field", [({"block_size": 0}, "block_size"), ({"alignment": 0}, "alignment"),
                                      ({"kv_format": "int4"}, "kv_format"), ({"index_format": "fp8_v4"}, "index_format"),
                                      ({"window_format": "fp4"}, "window_format")])
def test_bad_layout_arguments(flash: Topology, kw: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        CacheLayout(flash, **kw)
    assert e.value.field == field


def test_region_lookup_and_sharing_by_identity(flash: Topology) -> None:
    lay = CacheLayout(flash)
    assert lay.reads_region(26, "kv") is lay.region(20, "kv")
    assert lay.reads_region(24, "index_k") is lay.region(20, "index_k")
    assert lay.reads_region(5, "kv") is lay.region(2, "kv")
    assert lay.write_regions(2, "kv") == (lay.region(2, "kv"),)
    for layer in (0, 3, 24, 39, 40):
        for kind in ("kv", "index_k"):
            with pytest.raises(KeyError):
                lay.region(layer, kind)
    un = lay.unshared()
    assert un.reads_region(26, "kv").owner == 26 and un.region(25, "index_k").owner == 25
    assert [r.owner for r in un.write_regions(20, "kv")] == list(range(20, 40))


def test_capacity_arithmetic(flash: Topology) -> None:
    lay = CacheLayout(flash)
    mem, seqs = 80 * 2**30, 64
    blocks = lay.blocks_for_memory(mem, seqs)
    used = seqs * lay.state_bytes_per_seq
    assert used + blocks * lay.bytes_per_block <= mem < used + (blocks + 1) * lay.bytes_per_block
    assert lay.tokens_for_memory(mem, seqs) == (blocks - NULL_BLOCKS) * 128
    un = lay.unshared()
    ratio = lay.tokens_for_memory(mem, seqs) / un.tokens_for_memory(mem, seqs)
    assert ratio == pytest.approx(11.6, rel=1e-3)
    assert lay.blocks_for_memory(seqs * lay.state_bytes_per_seq, seqs) == 0
    assert lay.tokens_for_memory(1000, 1) == 0
    with pytest.raises(ValueError):
        lay.blocks_for_memory(-1, 1)


def test_offsets_are_python_ints_past_32_bits(flash: Topology) -> None:
    lay = CacheLayout(flash)
    off = lay.block_offset(40_000)
    assert isinstance(off, int) and off == 40_000 * 113_920 > 2**32


def test_layout_id_tracks_everything_that_changes_bytes(flash: Topology) -> None:
    ids = {CacheLayout(flash).layout_id, CacheLayout(flash, 256).layout_id,
           CacheLayout(flash, kv_format="fp8").layout_id, CacheLayout(flash, index_format="fp8").layout_id,
           CacheLayout(flash).unshared().layout_id, CacheLayout(flash, alignment=64).layout_id}
    assert len(ids) == 6
    assert CacheLayout(flash).layout_id == CacheLayout(Topology(load_config("deepseek-v4.1-flash"))).layout_id


def test_tiny_models_and_explicit_row_formats() -> None:
    topo = Topology(load_config("tiny-v41"))
    lay = CacheLayout(topo, block_size=8)
    assert (lay.kv_format.row_bytes, lay.index_format.row_bytes, lay.window_format.row_bytes) == (9, 9, 17)
    fmt = row_format("kv", "fp32", 16)
    assert CacheLayout(topo, block_size=8, kv_format=fmt).kv_format is fmt
    d = lay.to_dict(10**6, 2)
    assert d["bytes_per_block"] == lay.bytes_per_block and d["memory"]["tokens"] == lay.tokens_for_memory(10**6, 2)


@settings(max_examples=100, deadline=None)
@given(v41_configs(), st.sampled_from([2, 4, 8, 16, 64, 128, 256]), st.sampled_from([1, 8, 32, 256]),
       st.sampled_from(["fp4", "fp8", "bf16", "fp32"]), st.sampled_from(["fp4", "fp8", "bf16"]), st.booleans())
def test_layout_properties(d: dict[str, Any], block: int, align: int, kv: str, ik: str, share: bool) -> None:
    topo = build(d, share)
    lay = CacheLayout(topo, block, kv_format=kv, index_format=ik, alignment=align)
    regions = lay.regions
    end = 0
    for r in regions:
        assert r.offset == end and r.offset % align == 0 and r.nbytes_padded % align == 0  # disjoint, aligned
        assert r.nbytes <= r.nbytes_padded < r.nbytes + align
        assert r.rows == block // topo[r.owner].ratio
        end = r.end
    assert lay.bytes_per_block == end == sum(r.nbytes_padded for r in regions)
    kv_owners = set(lay.regions_map.kv_owners)
    ik_owners = set(lay.regions_map.index_owners)
    assert {r.owner for r in regions if r.kind == "kv"} == kv_owners
    assert {r.owner for r in regions if r.kind == "index_k"} == ik_owners
    assert [r.owner for r in regions] == sorted(r.owner for r in regions)
    for p in topo.layers:
        if share and not p.is_kv_source:
            with pytest.raises(KeyError):
                lay.region(p.layer, "kv")
        if p.kv_source is not None:
            assert lay.reads_region(p.layer, "kv").owner == (p.kv_source if share else p.layer)
    assert lay.unshared().bytes_per_block >= lay.bytes_per_block


def test_plain_formats_do_not_need_the_packed_defaults_to_fit() -> None:
    """A V4 model whose nope dims are no multiple of 64 still plans with plain rows (quant off)."""
    import json

    from kvshare.config import ModelConfig
    from kvshare.shipped import resolve_config_path

    d = json.loads(resolve_config_path("tiny-v4").read_text())
    d.update(head_dim=104, qk_rope_head_dim=8)  # nope 96: no multiple of fp8_v4's block of 64
    topo = Topology(ModelConfig.from_dict(d))
    lay = CacheLayout(topo, kv_format="fp32", index_format="fp32", window_format="fp32")
    assert lay.kv_format.row_bytes == 104 * 4
    with pytest.raises(ConfigError):
        CacheLayout(topo)  # negative control: the packed default does not fit these dims


@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41", "deepseek-v4-flash"])
@pytest.mark.parametrize("sb", [4, 8])
def test_compressor_ring_bytes_follow_the_state_dtype(name: str, sb: int) -> None:
    """A compressor ring row holds `width` values of `state_dtype_bytes` each, for the kv and the
    score tensor: hand count from the config (coff = 2 only for V4 ratio 4). With 8-byte states
    (the float64 oracle) a layout that sized rows as width * 4 would plan half the bytes the pool
    allocates (mutant "width*4 instead of width*sb": caught by both asserts)."""
    import torch

    from kvshare.cache.pool import BlockPool

    cfg = load_config(name)
    topo = Topology(cfg)
    lay = CacheLayout(topo, 128, state_dtype_bytes=sb)
    comp = [s for s in lay.states if s.name != "window"]
    assert comp
    for s in comp:
        ratio = topo[s.layer].ratio
        coff = 2 if cfg.arch == "v4" and ratio == 4 else 1
        dim = cfg.head_dim if s.name == "compressor" else cfg.index_head_dim
        assert (s.rows, s.width, s.row_bytes, s.nbytes) == (coff * ratio, coff * dim, coff * dim * sb,
                                                           2 * coff * ratio * coff * dim * sb)
    if cfg.num_hidden_layers <= 8:  # allocate only the tiny models
        pool = BlockPool(lay, num_blocks=2, num_slots=3, dtype=torch.float64 if sb == 8 else torch.float32)
        assert pool.ring_bytes == 3 * lay.state_bytes_per_seq
        assert {r.element_size() for k, r in pool.rings.items() if k[0] != "window"} == {sb}
