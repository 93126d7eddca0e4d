"""Ring: one per-slot ring of rows, the only place that maps a position to a ring row.

A ring holds, per request slot, the last positions of a sequence: position q lives at row
``q mod rows`` (floor modulo). ``rows = depth + slack``: `depth` is how far back a read reaches
(the sliding window W, a compressor's ``coff * ratio``), the slack rows (speculative decoding:
one per draft token) keep a rejected position's row off every row a later read still needs.
Rows are stored in the ring's own encoding: packed bytes of a `RowFormat` (window rings of the
paged pool) or plain values (compressor states, the dense cache), cast to the ring's dtype.

Every user goes through it: the paged backend and the dense cache (history reads and the
end-of-step update), the prefix checkpoints (``snapshot`` / ``restore`` of boundary rows) and the
DSpark draft windows. Addresses come from `StepAddresses` (a `RingRead` / `RingWrite` computed once
per step for a given row count) or from explicit (slot, position) tensors.

Invariants: a read never indexes with a negative row (positions < 0 map to a valid row and are
masked to zeros); ``pack`` followed by ``unpack`` is the identity on values the ring's format
represents (fake-quantised rows); nothing here syncs with the host.
"""

from __future__ import annotations

import torch

from kvshare.cache.formats import RowFormat
from kvshare.kernels import rows as native_rows
from kvshare.step.addresses import RingRead, RingWrite


class Ring:
    """Rows ``data[slot, row]`` of `num_slots` slots (see module doc)."""

    def __init__(self, data: torch.Tensor, fmt: RowFormat | None, depth: int, width: int) -> None:
        if data.dim() != 3 or data.shape[1] < depth:
            raise ValueError(f"a ring needs [slots, rows >= depth {depth}, cols], got {tuple(data.shape)}")
        self.data = data
        self.fmt = fmt
        self.depth = depth
        self.width = width  # values per row (the unpacked width)
        self.rows = int(data.shape[1])  # depth + slack

    def address(self, positions: torch.Tensor) -> torch.Tensor:
        """Ring row of each position (``positions mod rows``)."""
        return positions.remainder(self.rows)

    # ---- encoding ------------------------------------------------------------------------------
    def pack(self, values: torch.Tensor) -> torch.Tensor:
        """Values -> the stored encoding (packed bytes, or the ring's dtype)."""
        return (values if self.fmt is None else self.fmt.pack(values)).to(self.data.dtype)

    def unpack(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return stored.to(dtype) if self.fmt is None else self.fmt.unpack(stored, dtype)

    # ---- reads -------------------------------------------------------------------------------
    def gather(self, slots: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [*positions.shape, width] of each slot's positions, valid = position >= 0);
        invalid entries are zeros. `slots` broadcasts against `positions`."""
        valid = positions >= 0
        slots, _ = torch.broadcast_tensors(slots, positions)
        rows = self.unpack(self.data[slots, self.address(positions)], dtype)
        return rows.masked_fill(~valid[..., None], 0), valid

    def window(self, read: RingRead, values: torch.Tensor) -> torch.Tensor:
        """[R, depth, width]: this step's `values` where ``read.in_step``, stored rows elsewhere,
        zeros before position 0 (the history read of the CacheBackend protocol)."""
        out = values[read.step_row]
        if read.any_stored:
            stored = self.unpack(self.data[read.slot, read.ring_row], values.dtype)
            out = torch.where(read.in_step[..., None], out, stored)
        if not read.all_valid:
            out = out.masked_fill(~read.valid[..., None], 0)
        return out

    def stored(self, read: RingRead, dtype: torch.dtype) -> torch.Tensor:
        """[R, depth, width]: the stored rows of a read that touches no step row (zeros where invalid)."""
        rows = self.unpack(self.data[read.slot, read.ring_row], dtype)
        return rows if read.all_valid else rows.masked_fill(~read.valid[..., None], 0)

    def stores_bytes_of(self, values: torch.Tensor) -> bool:
        """Whether storing `values` [T, width] copies each row's bytes unchanged (a plain encoding in
        the values' dtype, or plain values of the ring's dtype): `write_all` then copies them natively."""
        if values.dim() != 2 or not values.is_contiguous():
            return False
        if self.fmt is None:
            return self.data.dtype == values.dtype
        return (self.fmt.plain_dtype == values.dtype and self.data.dtype == torch.uint8
                and self.data.shape[2] == values.shape[1] * values.element_size())

    # ---- writes ------------------------------------------------------------------------------
    def write(self, write: RingWrite, values: torch.Tensor) -> None:
        """Store the step's kept rows (``values[write.tokens]``) at their ring rows."""
        self.data[write.slot, write.ring_row] = self.pack(values[write.tokens])

    def store(self, write: RingWrite, stored: torch.Tensor) -> None:
        """Store rows already in the ring's encoding (``pack`` of the kept rows) at their ring rows."""
        self.data[write.slot, write.ring_row] = stored

    def put(self, slots: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Store values[e] as position positions[e] of slot slots[e] (distinct rows per slot)."""
        self.data[slots, self.address(positions)] = self.pack(values)

    # ---- checkpoints -----------------------------------------------------------------------------
    def snapshot(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The stored encoding of each slot's positions (``[*positions.shape, cols]``; zeros where
        the position is < 0), for a checkpoint."""
        slots, _ = torch.broadcast_tensors(slots, positions)
        raw = self.data[slots, self.address(positions)]
        return raw.masked_fill((positions < 0)[..., None], 0)

    def restore(self, slot: int, positions: torch.Tensor, raw: torch.Tensor) -> None:
        """Write a snapshot's rows (stored encoding) back as `slot`'s positions."""
        self.data[slot, self.address(positions.to(self.data.device))] = raw.to(self.data.device)

    def reset(self, slots: torch.Tensor) -> None:
        """Zero the given slots' rows (a recycled slot starts empty)."""
        self.data.index_fill_(0, slots.to(self.data.device), 0)


def write_all(rings: list[Ring], write: RingWrite, values: list[torch.Tensor]) -> None:
    """``rings[i].write(write, values[i])`` for rings of one row count (one step's ring updates):
    rings whose rows are their values' bytes are copied in one native call; of the others, those of
    one encoding are packed in one call (packing is per row, so the stored bytes are those of
    separate writes)."""
    native = native_rows.serves(values[0])  # (one step's values: one device, no autograd)
    raw = [i for i, (ring, v) in enumerate(zip(rings, values)) if native and ring.stores_bytes_of(v)]
    if raw:
        native_rows.ring_store([rings[i].data for i in raw], [values[i] for i in raw], write.tokens, write.slot,
                               write.ring_row)
        if len(raw) == len(rings):
            return
        keep = [i for i in range(len(rings)) if i not in raw]
        rings, values = [rings[i] for i in keep], [values[i] for i in keep]
    if len(rings) == 1 or len({(v.shape, v.dtype, r.fmt) for r, v in zip(rings, values)}) != 1:
        for ring, v in zip(rings, values):
            ring.write(write, v)
        return
    packed = rings[0].pack(torch.stack(values)[:, write.tokens])
    for i, ring in enumerate(rings):
        ring.store(write, packed[i])
