"""Block allocator, slots, block tables and compressed-row addressing."""

import pytest
import torch

from kvshare.cache.blocks import (
    NULL_BLOCK, BlockAllocator, BlockManager, SlotAllocator, blocks_for_tokens, compressed_row_address,
)


def test_null_block_never_handed_out_and_refcounts():
    a = BlockAllocator(5)
    assert a.num_usable == 4 and a.num_free == 4
    got = a.allocate(4)
    assert sorted(got) == [1, 2, 3, 4] and NULL_BLOCK not in got
    assert a.num_free == 0
    with pytest.raises(MemoryError):
        a.allocate(1)
    a.incref(got[0])
    a.free([got[0]])
    assert a.num_free == 0 and a.refcount(got[0]) == 1
    a.free(got)
    assert a.num_free == 4 and all(a.refcount(b) == 0 for b in got)
    with pytest.raises(ValueError):
        a.free([got[1]])  # double free
    with pytest.raises(ValueError):
        a.free([NULL_BLOCK])
    with pytest.raises(ValueError):
        BlockAllocator(1)


def test_slots():
    s = SlotAllocator(2)
    x, y = s.allocate(), s.allocate()
    assert {x, y} == {0, 1}
    with pytest.raises(MemoryError):
        s.allocate()
    s.free(x)
    with pytest.raises(ValueError):
        s.free(x)
    assert s.allocate() == x


def test_block_manager_tables_grow_and_release():
    m = BlockManager(num_blocks=9, block_size=4, num_slots=2, max_model_len=16)
    assert m.max_blocks_per_seq == 4
    a = m.open_slot()
    m.grow(a, 5)  # 2 blocks
    assert len(m.block_ids[a]) == 2
    assert m.tables[a, :2].tolist() == m.block_ids[a] and m.tables[a, 2:].tolist() == [0, 0]
    m.grow(a, 8)  # still 2 blocks
    assert len(m.block_ids[a]) == 2
    b = m.open_slot()
    assert m.can_grow(b, 16) and not m.can_grow(b, 17 + 8)
    m.grow(b, 16)
    assert m.allocator.num_free == 2
    assert not set(m.block_ids[a]) & set(m.block_ids[b])
    with pytest.raises(ValueError):
        m.grow(b, 17)  # past max_model_len
    m.release(a)
    assert m.allocator.num_free == 4 and m.tables[a].tolist() == [0, 0, 0, 0]
    assert blocks_for_tokens(0, 4) == 0 and blocks_for_tokens(1, 4) == 1 and blocks_for_tokens(8, 4) == 2


@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_compressed_row_address_matches_rule(ratio):
    bs = 8
    tables = torch.tensor([[3, 5, 7, 0], [2, 4, 0, 0]])
    seq = torch.tensor([0, 0, 1, 1, 0, 1])
    j = torch.tensor([0, 3, 1, 15 // ratio, -1, 100])
    block, row, valid = compressed_row_address(tables, seq, j, ratio, bs)
    for e in range(len(j)):
        jj = int(j[e])
        if jj < 0 or (jj * ratio) // bs >= 4:
            assert not valid[e] and block[e] == 0 and row[e] == 0
            continue
        assert valid[e]
        assert int(block[e]) == int(tables[seq[e], (jj * ratio) // bs])
        assert int(row[e]) == ((jj * ratio) % bs) // ratio
        assert 0 <= int(row[e]) < bs // ratio


def test_compressed_rows_of_distinct_groups_never_collide():
    bs, ratio = 8, 2
    tables = torch.tensor([[1, 2, 3]])
    j = torch.arange(12)
    block, row, valid = compressed_row_address(tables, torch.zeros_like(j), j, ratio, bs)
    pairs = set(zip(block.tolist(), row.tolist()))
    assert valid.all() and len(pairs) == 12
