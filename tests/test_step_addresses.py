"""StepAddresses against per-row Python loops written from the definitions (step_addresses.py doc).

The batch mixes a fresh prompt, a decode row and a later chunk, with permuted slots, so every
address kind meets positions before 0, rows inside the step and rows from the ring.
"""

from __future__ import annotations

import pytest
import torch

from kvshare.step import StepBatch

STARTS, LENS, SLOTS = [0, 9, 30], [5, 1, 7], [2, 0, 1]


def _rows() -> list[tuple[int, int, int]]:
    """(token row, sequence, position) of every token of the batch, by hand."""
    out, t = [], 0
    for i, (s, n) in enumerate(zip(STARTS, LENS)):
        for k in range(n):
            out.append((t, i, s + k))
            t += 1
    return out


def _batch() -> StepBatch:
    return StepBatch.build(STARTS, LENS, SLOTS, block_tables=torch.tensor([[0, 3, 4], [5, 6, 7], [8, 9, 1]]))


@pytest.mark.parametrize("depth,ring_rows", [(4, 6), (3, 3)])
def test_ring_read_of_every_row_matches_the_definition(depth: int, ring_rows: int) -> None:
    addr = _batch().addresses()
    read = addr.ring_read(None, depth, ring_rows)
    first = {i: t for t, i, _ in reversed(_rows())}
    for t, i, p in _rows():
        for k in range(depth):
            q = p - depth + 1 + k
            assert bool(read.valid[t, k]) == (q >= 0)
            assert bool(read.in_step[t, k]) == (q >= STARTS[i])
            assert int(read.slot[t, k]) == SLOTS[i]
            assert int(read.ring_row[t, k]) == q % ring_rows  # Python's % is floor modulo
            if q >= STARTS[i]:
                assert int(read.step_row[t, k]) == first[i] + q - STARTS[i]
    assert read.any_stored and not read.all_valid
    assert addr.ring_read(None, depth, ring_rows) is read  # built once per step


def test_reads_of_the_first_rows_and_of_other_tensors_agree() -> None:
    """The memoised read of ``addr.first`` equals the read derived on the device for an equal tensor."""
    addr = _batch().addresses()
    known = addr.ring_read(addr.first, 4, 6)
    other = addr.ring_read(addr.first.clone(), 4, 6)
    for f in ("slot", "ring_row", "in_step", "valid"):
        assert torch.equal(getattr(known, f), getattr(other, f)), f
    assert torch.equal(torch.where(known.in_step, known.step_row, 0), torch.where(other.in_step, other.step_row, 0))


@pytest.mark.parametrize("ring_rows", [2, 6])
def test_ring_write_keeps_each_sequences_last_rows(ring_rows: int) -> None:
    w = _batch().addresses().ring_write(ring_rows)
    want = [(t, SLOTS[i], p % ring_rows) for t, i, p in _rows() if p >= STARTS[i] + LENS[i] - ring_rows]
    got = list(zip(w.tokens.tolist(), w.slot.tolist(), w.ring_row.tolist()))
    assert got == want


@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_groups_prefix_and_addresses_match_the_definition(ratio: int) -> None:
    batch = _batch()
    addr = batch.addresses()
    g = addr.groups(ratio)
    want = [(t, i, (p + 1) // ratio - 1) for t, i, p in _rows() if (p + 1) % ratio == 0]
    assert list(zip(g.rows.tolist(), g.seq.tolist(), g.j.tolist())) == want
    assert g.positions.tolist() == [j * ratio for _, _, j in want]
    assert (g.count, g.last) == (len(want), max(j for _, _, j in want))
    assert g.min_pos == min(p for t, i, p in _rows() if (p + 1) % ratio == 0)
    pre = addr.prefix(ratio)
    n_rows = [(s + n) // ratio for s, n in zip(STARTS, LENS)]
    assert pre.n_rows.tolist() == n_rows and pre.width == max(n_rows)
    assert pre.mask.tolist() == [[c < n for c in range(pre.width)] for n in n_rows]
    assert pre.compress_len.tolist() == [(p + 1) // ratio for _, _, p in _rows()]
    assert pre.causal.tolist() == [[c < (p + 1) // ratio for c in range(pre.width)] for _, _, p in _rows()]
    assert addr.prefix_of(pre.n_rows) is pre and addr.prefix_of(pre.n_rows.clone()) is None
    # the paged address of entry j: logical block (j * r) // B, row ((j * r) % B) // r
    bs = 8
    block, row, valid = addr.compressed_address(g, batch.block_tables, bs)
    for e, (_, i, j) in enumerate(want):
        lb = j * ratio // bs
        assert bool(valid[e]) == (lb < 3)
        if lb < 3:
            assert (int(block[e]), int(row[e])) == (int(batch.block_tables[i, lb]), (j * ratio) % bs // ratio)


def test_rows_layout_and_phase() -> None:
    addr = _batch().addresses()
    rows = addr.rows_layout()
    assert (rows.lens, rows.starts, rows.max_len) == (LENS, STARTS, 7)
    assert rows.rank.tolist() == [p - STARTS[i] for _, i, p in _rows()]
    assert addr.phase(4).tolist() == [p % 4 for _, _, p in _rows()]


def test_a_batch_without_host_lists_reads_them_once() -> None:
    b = _batch()
    bare = StepBatch(b.positions, b.seq_index, b.cu_seqlens, b.starts, b.lens, b.slots, b.block_tables)
    assert bare.host_lists() == (STARTS, LENS, SLOTS)
    assert bare.addresses().groups(2).j.tolist() == b.addresses().groups(2).j.tolist()


@pytest.mark.parametrize("by_sequence", [None, True, False])
def test_ops_with_host_rows_give_the_bits_of_the_device_derived_path(by_sequence: bool | None,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """prefix_attention and index_scores told the row layout by the addresses (no host reads)
    return exactly what they return when they derive it from seq_index themselves; the mixed
    case (a long chunk next to short ones) splits the step the same way."""
    import kvshare.ops.prefix_attention as pa
    from kvshare.ops.index_scores import index_scores

    monkeypatch.setattr(pa, "BY_SEQUENCE_MIN_ROWS", 5)
    b = _batch()
    addr = b.addresses()
    g = torch.Generator().manual_seed(0)
    t, n, h, d, p_len, length = b.num_tokens, b.num_seqs, 3, 8, 3, 6
    q = torch.randn(t, h, d, generator=g)
    win = torch.randn(n, p_len + addr.max_len, d, generator=g)
    comp = torch.randn(n, length, d, generator=g)
    comp_mask = torch.rand(t, length, generator=g) < 0.6
    sink = torch.randn(h, generator=g)
    args = (q, win, b.starts, comp, comp_mask, b.seq_index, addr.rank, sink, 0.3)
    want = pa.prefix_attention(*args, block=2, by_sequence=by_sequence)
    got = pa.prefix_attention(*args, block=2, by_sequence=by_sequence, rows=addr.rows_layout())
    assert torch.equal(got, want)
    w = torch.randn(t, h, generator=g)
    keys = torch.randn(n, length, d, generator=g)
    for budget in (1 << 25, h * length * n):  # one block of rows; blocks of one row (sequences drop out)
        assert torch.equal(index_scores(q, w, keys, b.seq_index, budget, rows=addr.rows_layout()),
                           index_scores(q, w, keys, b.seq_index, budget))
