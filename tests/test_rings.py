"""cache.rings.Ring against a dict {(slot, position): row} kept by hand: writes, window reads,
snapshots and restores, in a packed row format and in plain values, with slack rows."""

from __future__ import annotations

import pytest
import torch

from kvshare.cache.formats import row_format
from kvshare.cache.rings import Ring
from kvshare.step import StepBatch


def _ring(packed: bool, slots: int = 3, depth: int = 4, slack: int = 2) -> Ring:
    fmt = row_format("window", "fp8_v41", 32) if packed else None
    cols = fmt.row_bytes if fmt is not None else 32
    data = torch.zeros(slots, depth + slack, cols, dtype=torch.uint8 if packed else torch.float32)
    return Ring(data, fmt, depth, 32)


def _value(ring: Ring, slot: int, pos: int) -> torch.Tensor:
    """A row depending on (slot, pos), already representable in the ring's format."""
    v = torch.linspace(-1, 1, 32) * (1 + slot) + pos / 8
    return ring.fmt.fake_quant(v) if ring.fmt is not None else v


@pytest.mark.parametrize("packed", [False, True])
def test_steps_of_writes_and_reads_match_a_dict(packed: bool) -> None:
    ring = _ring(packed)
    stored: dict[tuple[int, int], torch.Tensor] = {}
    # three steps: a prompt of 7 in slot 2 with a 2-token chunk of slot 0; then decodes; then a chunk
    for starts, lens, slots in (([0, 0], [7, 2], [2, 0]), ([7, 2], [1, 1], [2, 0]), ([8, 3], [1, 5], [2, 1])):
        batch = StepBatch.build(starts, lens, slots)
        addr = batch.addresses()
        pos, seq = batch.positions.tolist(), batch.seq_index.tolist()
        values = torch.stack([_value(ring, slots[i], p) for p, i in zip(pos, seq)])
        read = addr.ring_read(None, ring.depth, ring.rows)
        out = ring.window(read, values)
        for t, (p, i) in enumerate(zip(pos, seq)):
            for k in range(ring.depth):
                q = p - ring.depth + 1 + k
                if q < 0:
                    want = torch.zeros(32)
                elif q >= starts[i]:
                    want = values[t - (p - q)]
                else:
                    want = stored.get((slots[i], q), torch.zeros(32))  # slot 1 starts at 3: rows 0-2 unwritten
                assert torch.equal(out[t, k], want), (t, k)
        ring.write(addr.ring_write(ring.rows), values)
        for t, (p, i) in enumerate(zip(pos, seq)):
            stored[(slots[i], p)] = values[t]
        # the ring holds each slot's last `rows` positions
        for (s, q), v in stored.items():
            last = max(p for (s2, p) in stored if s2 == s)
            if q > last - ring.rows:
                got, ok = ring.gather(torch.tensor([s]), torch.tensor([q]), torch.float32)
                assert bool(ok[0]) and torch.equal(got[0], v)


@pytest.mark.parametrize("packed", [False, True])
def test_snapshot_restore_round_trip_into_another_slot(packed: bool) -> None:
    ring = _ring(packed)
    slots = torch.tensor([1, 1, 1, 1, 1, 1])
    pos = torch.arange(6)
    ring.put(slots, pos, torch.stack([_value(ring, 1, p) for p in range(6)]))
    q = torch.arange(1, 6)  # positions 1..5 (position 0's row was overwritten: 6 rows)
    raw = ring.snapshot(torch.tensor(1), q)
    ring.restore(0, q, raw)
    got, valid = ring.gather(torch.tensor(0), q, torch.float32)
    assert bool(valid.all())
    assert torch.equal(got, torch.stack([_value(ring, 1, p) for p in range(1, 6)]))
    assert torch.equal(ring.snapshot(torch.tensor(1), torch.tensor([-2, -1])), torch.zeros(2, ring.data.shape[-1],
                                                                                      dtype=ring.data.dtype))
    ring.reset(torch.tensor([0]))
    assert int(ring.data[0].count_nonzero()) == 0 and int(ring.data[1].count_nonzero()) > 0


def test_a_ring_shorter_than_its_depth_is_refused() -> None:
    with pytest.raises(ValueError, match="rows >= depth"):
        Ring(torch.zeros(2, 3, 4), None, 4, 4)


def test_writing_several_rings_at_once_stores_the_bytes_of_separate_writes() -> None:
    from kvshare.cache.rings import write_all

    batch = StepBatch.build([3, 0], [2, 6], [1, 2])
    w = batch.addresses().ring_write(6)
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(8, 32, generator=g) for _ in range(3)]
    together, apart = [_ring(True) for _ in range(3)], [_ring(True) for _ in range(3)]
    write_all(together, w, values)
    for ring, v in zip(apart, values):
        ring.write(w, v)
    assert all(torch.equal(a.data, b.data) for a, b in zip(together, apart))
    assert all(int(a.data.count_nonzero()) > 0 for a in together)


def test_plain_rings_of_mixed_widths_and_encodings_are_stored_natively_as_separate_writes() -> None:
    """`write_all` over rings of one row count but mixed encodings (plain bf16 bytes in a uint8 ring,
    plain fp32 values, a packed fp8 ring, a strided ring view): the native copy of the plain ones
    (`kernels.rows.ring_store`) and the packing of the rest leave every ring as separate `Ring.write`s
    would, byte for byte. Mutation caught: the copy addressing rows by ``row * cols`` without the
    slot stride (the strided view's rows land in the wrong slot)."""
    from kvshare.cache.rings import write_all
    from kvshare.kernels import rows as native_rows

    if not native_rows.serves(torch.zeros(1)):
        pytest.skip("native kernels unavailable")
    batch = StepBatch.build([3, 0], [2, 6], [1, 2])
    w = batch.addresses().ring_write(6)
    g = torch.Generator().manual_seed(1)
    bf16 = row_format("window", "bf16", 32)

    def rings() -> list[Ring]:
        big = torch.zeros(3, 6, 2, 64, dtype=torch.uint8)  # a strided view: [:, :, 1] of a larger buffer
        return [Ring(torch.zeros(3, 6, bf16.row_bytes, dtype=torch.uint8), bf16, 4, 32),
                Ring(torch.zeros(3, 6, 48), None, 4, 48),
                _ring(True),
                Ring(big[:, :, 1], bf16, 4, 32)]

    values = [torch.randn(8, 32, generator=g).bfloat16(), torch.randn(8, 48, generator=g),
              torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g).bfloat16()]
    together, apart = rings(), rings()
    stored = []
    real = native_rows.ring_store
    native_rows.ring_store = lambda r, v, *a: stored.append(len(r)) or real(r, v, *a)
    try:
        write_all(together, w, values)
    finally:
        native_rows.ring_store = real
    for ring, v in zip(apart, values):
        ring.write(w, v)
    assert stored == [3]  # the three plain rings in one call; the fp8 ring packed
    assert all(torch.equal(a.data, b.data) for a, b in zip(together, apart))
    assert all(int(a.data.count_nonzero()) > 0 for a in together)
    with pytest.raises(RuntimeError, match="outside ring"):
        native_rows.ring_store([together[0].data], [values[0]], w.tokens, w.slot + 5, w.ring_row)
