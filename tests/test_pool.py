"""BlockPool and PagedBackend: byte accounting, aliasing, non-overlap, sentinels, paged == dense rows."""

import pytest
import torch

from kvshare.cache.layout import CacheLayout
from kvshare.cache.paged_backend import PagedBackend
from kvshare.cache.pool import BlockPool
from kvshare.config import load_config
from kvshare.cache.dense import DenseCache
from kvshare.step import StepBatch
from kvshare.topology import Topology

CONFIGS = ["tiny-v41", "tiny-v41-deep", "tiny-v4", "kvshare-mini-v41"]


def _layout(name: str, share: bool = True, fmt: str | None = None) -> CacheLayout:
    cfg = load_config(name)
    topo = Topology(cfg, share_cache=share)
    bs = 128 if cfg.arch == "v4" else 16
    return CacheLayout(topo, bs, kv_format=fmt, index_format=fmt, window_format=fmt)


@pytest.mark.parametrize("name", CONFIGS)
def test_pool_bytes_equal_the_plan(name):
    lay = _layout(name)
    pool = BlockPool(lay, num_blocks=7, num_slots=2)
    assert pool.block_bytes == 7 * lay.bytes_per_block
    assert pool.blocks.shape == (7, lay.bytes_per_block)
    for r in lay.regions:
        v = pool.owner_views()[(r.kind, r.owner)]
        assert v.shape == (7, r.rows, r.row_bytes)
        assert v.data_ptr() == pool.blocks.data_ptr() + r.offset
        assert v.stride() == (lay.bytes_per_block, r.row_bytes, 1)
    # Every ring the layout plans is allocated at creation (window and compressor states alike).
    assert pool.ring_bytes == 2 * lay.state_bytes_per_seq


@pytest.mark.parametrize("name", CONFIGS)
def test_sharing_layers_get_the_owner_view_object(name):
    lay = _layout(name)
    pool, topo = BlockPool(lay, 3, 1), lay.topo
    compressed = [p.layer for p in topo.layers if p.is_compressed]
    for layer in compressed:
        owner = topo[layer].kv_source
        assert pool.kv_view(layer) is pool.kv_view(owner)
        assert pool.kv_view(layer).data_ptr() == pool.kv_view(owner).data_ptr()
        if topo[layer].index_k_source is not None:
            assert pool.index_k_view(layer) is pool.index_k_view(topo[layer].index_k_source)
    n_views = len({id(pool.kv_view(l)) for l in compressed})
    assert n_views == len({p.kv_source for p in topo.layers if p.is_compressed})


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("share", [True, False])
def test_fill_and_check_regions_do_not_overlap(name, share):
    lay = _layout(name, share)
    pool = BlockPool(lay, 4, 1)
    views = pool.owner_views()
    for i, v in enumerate(views.values()):
        v.fill_(i + 1)
    for i, v in enumerate(views.values()):
        assert bool((v == i + 1).all()), "a region was overwritten by another"
    covered = sum(v.numel() for v in views.values())
    assert covered == sum(r.nbytes for r in lay.regions) * 4


@pytest.mark.parametrize("name", CONFIGS)
def test_unshared_multiplies_bytes_per_token_by_the_planner_factor(name):
    shared, unshared = _layout(name, True), _layout(name, False)
    ps, pu = BlockPool(shared, 5, 1), BlockPool(unshared, 5, 1)
    ratio = pu.block_bytes / ps.block_bytes
    assert ratio == pytest.approx(shared.saving_factor)
    if load_config(name).arch == "v41":
        assert ratio > 1.5


def _batch(starts, lens, slots, tables):
    return StepBatch.build(starts, lens, slots, block_tables=torch.tensor(tables))


def test_minus_one_never_touches_live_rows_with_negative_control():
    lay = _layout("tiny-v41", fmt="fp32")
    pool = BlockPool(lay, 4, 2)
    be = PagedBackend(pool)
    owner = lay.regions_map.kv_owners[0]
    view = pool.kv_view(owner)
    view[1:].fill_(7)  # live blocks 1..3 hold a sentinel pattern
    snapshot = view[1:].clone()
    b = _batch([0], [4], [0], [[1, 2, 3]])
    w = lay.kv_format.dim
    # write through index -1: must land in the null block only
    be.write_rows("kv", owner, torch.tensor([0, 0]), torch.tensor([-1, -1]), torch.ones(2, w), b)
    assert torch.equal(view[1:], snapshot)
    got = be.gather_rows("kv", owner, torch.tensor([0]), torch.tensor([[-1, -1]]), b)
    assert bool((got == 0).all())
    # negative control: torch's own -1 would wrap onto the last live block
    assert bool((view[torch.tensor(-1)] == 7).all())
    # positive control: a real index does land in a live row
    be.write_rows("kv", owner, torch.tensor([0]), torch.tensor([0]), torch.ones(1, w), b)
    assert not torch.equal(view[1:], snapshot)


@pytest.mark.parametrize("fmt", ["fp32", None])
def test_paged_rows_and_history_match_dense_cache(fmt):
    """Random ragged schedules: every gather of the paged backend equals the dense reference."""
    cfg = load_config("tiny-v41")
    lay = _layout("tiny-v41", fmt=fmt)
    topo = lay.topo
    pool = BlockPool(lay, 12, 3)
    paged, dense = PagedBackend(pool), DenseCache(cfg, topo, 3, 64)
    g = torch.Generator().manual_seed(0)
    owner = lay.regions_map.kv_owners[-1]
    r = topo[owner].ratio
    tables = torch.tensor([[3, 5, 1, 0], [2, 4, 6, 0], [7, 8, 9, 10]])
    done = [0, 0, 0]
    kvf, winf = lay.kv_format, lay.window_format
    for step in range(6):
        lens = [int(torch.randint(1, 9, (1,), generator=g)) for _ in range(3)]
        b = StepBatch.build(done, lens, [0, 1, 2], block_tables=tables)
        new_j = [list(range(done[i] // r, (done[i] + lens[i]) // r)) for i in range(3)]
        seq = torch.tensor([i for i in range(3) for _ in new_j[i]], dtype=torch.int64)
        j = torch.tensor([x for i in range(3) for x in new_j[i]], dtype=torch.int64)
        vals = kvf.fake_quant(torch.randn(len(j), kvf.dim, generator=g))
        win = winf.fake_quant(torch.randn(b.num_tokens, winf.dim, generator=g))
        for be in (paged, dense):
            if len(j):
                be.write_rows("kv", owner, seq, j, vals, b)
        hp, vp = paged.history("window", 0, win, cfg.sliding_window, b)
        hd, vd = dense.history("window", 0, win, cfg.sliding_window, b)
        assert torch.equal(vp, vd) and torch.equal(hp, hd)
        n_rows = b.ends // r
        (pp, mp), (pd, md) = paged.gather_prefix("kv", owner, n_rows, b), dense.gather_prefix("kv", owner, n_rows, b)
        assert torch.equal(mp, md) and torch.equal(pp, pd)
        idx = torch.randint(-1, int(n_rows.min()) + 1, (b.num_tokens, 3), generator=g)
        idx = torch.where(idx >= n_rows[b.seq_index][:, None], torch.full_like(idx, -1), idx)
        assert torch.equal(paged.gather_rows("kv", owner, b.seq_index, idx, b),
                           dense.gather_rows("kv", owner, b.seq_index, idx, b))
        paged.end_step()
        done = [d + n for d, n in zip(done, lens)]


def test_offsets_are_int64_past_4_gib():
    """V4.1-Flash fp4 blocks (113,920 B): block 40,000 starts past 2^32; views must address it exactly."""
    cfg = load_config("deepseek-v4.1-flash")
    lay = CacheLayout(Topology(cfg), 128)
    assert lay.bytes_per_block == 113920
    pool = BlockPool(lay, num_blocks=40001, num_slots=1, device="meta")
    for r in lay.regions:
        v = pool.owner_views()[(r.kind, r.owner)]
        row = v[40000, r.rows - 1]
        assert row.storage_offset() == 40000 * 113920 + r.offset + (r.rows - 1) * r.row_bytes > 2**32


def test_reset_slots_zeroes_only_those_slots():
    lay = _layout("tiny-v41")
    pool = BlockPool(lay, 3, 3)
    for r in pool.rings.values():
        r.fill_(9)
    pool.reset_slots(torch.tensor([1]))
    for r in pool.rings.values():
        assert bool((r[1] == 0).all()) and bool((r[0] == 9).all()) and bool((r[2] == 9).all())
