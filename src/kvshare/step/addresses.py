"""StepAddresses: every index a step's layers and cache need, derived once per step on the host.

A step's chunks are known on the host before the forward (chunk starts, lengths, request slots:
``StepBatch.host``). Everything that depends on them is computed here from those host ints with
numpy and moved to the device once: which token rows complete a compressed group of ratio r (and
their entry indices), which positions a ring read touches and whether any of them is stored,
which rows a ring update keeps, how many compressed rows each sequence has, the widest of them,
each row's causal compressed length. The layers (through ``StepContext.addr``) and the cache
backend (through ``batch.addresses()``) only look these up, so the layer loop makes no host sync.

Each address is built the first time a layer asks for it and kept for the rest of the step
(memoised per key: a ratio, a ring's row count, a block size), so a step pays for each once however
many layers use it. Tensors handed out are never modified; backends recognise the requested rows
of a ring read by identity (``rows is addr.first`` ...), so a caller passing its own index tensor
still gets a correct, freshly derived address (no host sync either: host-only shortcuts are then
skipped).

Invariants: ring row of position q = ``q mod rows`` (floor modulo, as ``torch.remainder``);
``step_row`` is clamped into ``[0, T)`` and only meaningful where ``in_step``; ``valid`` is False
for positions < 0; compressed entry j of ratio r is completed by the token at position
``(j + 1) * r - 1`` and is addressed at its first position ``j * r``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Protocol

import numpy as np
import torch


class ChunkBatch(Protocol):
    """What the addresses read of a step's batch (`step.batch.StepBatch`, which builds them: so this
    module needs no import of it)."""

    positions: torch.Tensor
    seq_index: torch.Tensor
    cu_seqlens: torch.Tensor
    starts: torch.Tensor
    slots: torch.Tensor

    def host_lists(self) -> tuple[list[int], list[int], list[int]]: ...


@dataclass(frozen=True)
class RingRead:
    """Where the rows of positions ``p - depth + 1 .. p`` of R requested token rows come from.

    Tensors are [R, depth]: ``slot`` and ``ring_row`` address the stored ring, ``step_row`` this
    step's values; ``in_step`` picks the step's values, ``valid`` is False before position 0.
    Host flags: ``any_stored`` (some valid position comes from the ring), ``all_valid``.
    """

    slot: torch.Tensor
    ring_row: torch.Tensor
    step_row: torch.Tensor
    in_step: torch.Tensor
    valid: torch.Tensor
    any_stored: bool
    all_valid: bool


@dataclass(frozen=True)
class RingWrite:
    """The step's rows a ring of `rows` rows keeps: token rows ``tokens`` [K] go to
    ``(slot, ring_row)`` [K] (each sequence's last `rows` positions)."""

    tokens: torch.Tensor
    slot: torch.Tensor
    ring_row: torch.Tensor


@dataclass(frozen=True)
class Groups:
    """Compressed entries of ratio r completed in this step: token ``rows`` [E] (the group's last
    token), their sequence ``seq`` [E] and entry index ``j`` [E]; ``positions`` = j * r (RoPE);
    host ints ``count`` = E, ``last`` = max j (-1 when none) and ``min_pos`` = the smallest
    completing position (a ring read of depth D reaches before position 0 iff min_pos < D - 1)."""

    ratio: int
    rows: torch.Tensor
    seq: torch.Tensor
    j: torch.Tensor
    positions: torch.Tensor
    count: int
    last: int
    min_pos: int


@dataclass(frozen=True)
class SeqRows:
    """How a step's token rows sit per sequence (the ops' address inputs): each sequence's rows are
    contiguous and in position order; ``lens`` / ``starts`` host ints, ``max_len`` = max lens,
    ``rank`` [T] each row's index within its sequence's chunk."""

    lens: list[int]
    starts: list[int]
    max_len: int
    rank: torch.Tensor


@dataclass(frozen=True)
class Prefix:
    """Compressed rows ``[0, n_rows[i])`` of each sequence for ratio r after this step.

    ``width`` (host) = max n_rows; ``mask`` [N, width]; ``compress_len`` [T] = (pos + 1) // r, the
    causal bound of each token row; ``causal`` [T, width] = column < compress_len. The two masks
    are built on first use (the native paths read only the counts)."""

    ratio: int
    n_rows: torch.Tensor
    width: int
    compress_len: torch.Tensor
    build_masks: Callable[[], torch.Tensor]  # [N + T, width] bool: mask, then causal

    @cached_property
    def _masks(self) -> torch.Tensor:
        return self.build_masks()

    @property
    def mask(self) -> torch.Tensor:
        return self._masks[:self.n_rows.shape[0]]

    @property
    def causal(self) -> torch.Tensor:
        return self._masks[self.n_rows.shape[0]:]


class StepAddresses:
    """The addresses of one step (module doc). Build with ``batch.addresses()``."""

    def __init__(self, batch: ChunkBatch) -> None:
        self.batch = batch
        self.device = batch.positions.device
        starts, lens, slots = batch.host_lists()
        self.starts, self.lens, self.slots = starts, lens, slots
        self.num_seqs = len(lens)
        self.num_tokens = int(sum(lens))
        self.max_len = max(lens) if lens else 0
        self._starts = np.asarray(starts, dtype=np.int64)
        self._lens = np.asarray(lens, dtype=np.int64)
        self._slots = np.asarray(slots, dtype=np.int64)
        self._cu = np.zeros(self.num_seqs + 1, dtype=np.int64)
        np.cumsum(self._lens, out=self._cu[1:])
        self._seq = np.repeat(np.arange(self.num_seqs, dtype=np.int64), self._lens)
        self._pos = np.arange(self.num_tokens, dtype=np.int64) - self._cu[:-1][self._seq] + self._starts[self._seq]
        self._ends = self._starts + self._lens
        self.first = batch.cu_seqlens[:-1]  # each sequence's first token row
        self.rank = self._tensor(np.arange(self.num_tokens, dtype=np.int64) - self._cu[:-1][self._seq])
        self._memo: dict[tuple, object] = {}

    def rows_layout(self) -> SeqRows:
        """The step's `SeqRows` (host lens and starts, row ranks)."""
        return self._cached(("rows",), lambda: SeqRows(self.lens, self.starts, self.max_len, self.rank))  # type: ignore[return-value]

    def _tensor(self, a: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=self.device, dtype=dtype)

    def _cached(self, key: tuple, build):  # noqa: ANN001, ANN202
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = build()
        return hit

    # ---- rings ---------------------------------------------------------------------------------
    def ring_read(self, rows: torch.Tensor | None, depth: int, ring_rows: int) -> RingRead:
        """The read of the last `depth` positions up to each requested row (None: every row; the
        step's own `first` or a `groups(r).rows` tensor: memoised; any other tensor: derived on
        the device, with conservative host flags)."""
        if rows is None:
            return self._cached(("read", None, depth, ring_rows),
                                lambda: self._ring_read_host(np.arange(self.num_tokens), depth, ring_rows))
        key = ("read", id(rows), depth, ring_rows)
        hit = self._memo.get(key)
        if hit is not None:
            return hit  # type: ignore[return-value]
        known = self._known_rows(rows)
        if known is None:
            return self._ring_read_device(rows, depth, ring_rows)
        read = self._memo[key] = self._ring_read_host(known, depth, ring_rows)
        self._memo[("keep", id(rows))] = rows  # id stays unique while the memo holds the tensor
        return read

    def _known_rows(self, rows: torch.Tensor) -> np.ndarray | None:
        if rows is self.first:
            return self._cu[:-1]
        for key, g in self._memo.items():
            if key[0] == "groups" and isinstance(g, Groups) and g.rows is rows:
                return self._group_rows(g.ratio)
        return None

    def _ring_read_host(self, rows: np.ndarray, depth: int, ring_rows: int) -> RingRead:
        seq = self._seq[rows]
        q = self._pos[rows][:, None] - depth + 1 + np.arange(depth, dtype=np.int64)[None, :]
        start = self._starts[seq][:, None]
        valid = q >= 0
        in_step = q >= start
        step_row = np.clip(self._cu[:-1][seq][:, None] + q - start, 0, max(self.num_tokens - 1, 0))
        slot = np.broadcast_to(self._slots[seq][:, None], q.shape)
        idx = self._tensor(np.stack([slot, np.mod(q, ring_rows), step_row]))
        masks = self._tensor(np.stack([in_step, valid]), torch.bool)
        return RingRead(idx[0], idx[1], idx[2], masks[0], masks[1], bool((valid & ~in_step).any()),
                        bool(valid.all()))

    def _ring_read_device(self, rows: torch.Tensor, depth: int, ring_rows: int) -> RingRead:
        b = self.batch
        seq = b.seq_index[rows]
        q = b.positions[rows][:, None] - depth + 1 + torch.arange(depth, device=rows.device)[None, :]
        start = b.starts[seq][:, None]
        step_row = (b.cu_seqlens[seq][:, None] + q - start).clamp(0, max(self.num_tokens - 1, 0))
        slot = b.slots[seq][:, None].expand_as(q)
        return RingRead(slot, q.remainder(ring_rows), step_row, q >= start, q >= 0, True, False)

    def window_meta(self, by_sequence: bool = False) -> torch.Tensor:
        """[T, 4] int64 per token row: (slot, position, its chunk's start position, its chunk's first
        token row): what a kernel needs to address a window read in place (cache/in_place.py).
        `by_sequence`: the row's sequence (0..N-1) in place of its slot, for a ring copy holding the
        step's slots in batch order."""
        def build() -> torch.Tensor:
            seq = self._seq
            first = seq if by_sequence else self._slots[seq]
            return self._tensor(np.stack([first, self._pos, self._starts[seq], self._cu[:-1][seq]], 1))
        return self._cached(("window_meta", by_sequence), build)  # type: ignore[return-value]

    def ring_write(self, ring_rows: int) -> RingWrite:
        """The rows a ring of `ring_rows` rows keeps after this step (see RingWrite)."""
        def build() -> RingWrite:
            keep = np.flatnonzero(self._pos >= self._ends[self._seq] - ring_rows)
            idx = self._tensor(np.stack([keep, self._slots[self._seq[keep]], np.mod(self._pos[keep], ring_rows)]))
            return RingWrite(idx[0], idx[1], idx[2])
        return self._cached(("write", ring_rows), build)  # type: ignore[return-value]

    # ---- compressed entries --------------------------------------------------------------------
    def _group_rows(self, ratio: int) -> np.ndarray:
        return np.flatnonzero((self._pos + 1) % ratio == 0)

    def groups(self, ratio: int) -> Groups:
        """The entries of ratio `ratio` completed in this step (see Groups)."""
        def build() -> Groups:
            b = self.batch
            if ratio == 1:
                last = int(self._ends.max()) - 1 if self.num_seqs else -1
                return Groups(1, torch.arange(self.num_tokens, device=self.device), b.seq_index, b.positions,
                              b.positions, self.num_tokens, last, int(self._starts.min()) if self.num_seqs else 0)
            rows = self._group_rows(ratio)
            if not len(rows):  # (most decode steps): four views of one empty tensor
                e = self._tensor(rows)
                return Groups(ratio, e, e, e, e, 0, -1, 1 << 62)
            j = (self._pos[rows] + 1) // ratio - 1
            idx = self._tensor(np.stack([rows, self._seq[rows], j, j * ratio]))
            return Groups(ratio, idx[0], idx[1], idx[2], idx[3], len(rows), int(j.max()), int(self._pos[rows].min()))
        return self._cached(("groups", ratio), build)  # type: ignore[return-value]

    def phase(self, ratio: int) -> torch.Tensor:
        """[T] each token's position within its group of `ratio` (``pos mod ratio``; the APE row)."""
        return self._cached(("phase", ratio), lambda: self._tensor(self._pos % ratio))  # type: ignore[return-value]

    def prefix(self, ratio: int) -> Prefix:
        """Every sequence's compressed rows of ratio `ratio` after this step (see Prefix)."""
        def build() -> Prefix:
            n_rows = self._ends // ratio
            width = int(n_rows.max()) if n_rows.size else 0
            cols = np.arange(width, dtype=np.int64)
            compress_len = (self._pos + 1) // ratio
            n_t = self._tensor(np.concatenate([n_rows, compress_len]))
            n = self.num_seqs
            return Prefix(ratio, n_t[:n], width, n_t[n:], lambda: self._tensor(np.concatenate(
                [cols[None, :] < n_rows[:, None], cols[None, :] < compress_len[:, None]]), torch.bool))
        return self._cached(("prefix", ratio), build)  # type: ignore[return-value]

    def causal_picks(self, ratio: int, k: int) -> torch.Tensor:
        """[T, k] int64: every row's causal compressed entries ``0 .. (pos + 1) // ratio - 1`` in
        ascending order, -1 padded (a top-k selection when no row has more than k entries)."""
        def build() -> torch.Tensor:
            j = np.arange(k, dtype=np.int64)[None, :]
            return self._tensor(np.where(j < ((self._pos + 1) // ratio)[:, None], j, -1))
        return self._cached(("causal_picks", ratio, k), build)  # type: ignore[return-value]

    def length_buckets(self, ratio: int, bucket: int) -> list[tuple[int, torch.Tensor]]:
        """Token rows grouped by their causal compressed count ``(pos + 1) // ratio`` rounded up to
        a multiple of `bucket` (at least `bucket`): ``[(bucket length, rows [G])]``, ascending.
        The batch-invariant products (ops/invariant.py) give each group one shape."""
        def build() -> list[tuple[int, torch.Tensor]]:
            n = (self._pos + 1) // ratio
            b = np.maximum(n + (bucket - 1), bucket) // bucket * bucket
            return [(int(v), self._tensor(np.flatnonzero(b == v))) for v in np.unique(b)]
        return self._cached(("buckets", ratio, bucket), build)  # type: ignore[return-value]

    def prefix_of(self, n_rows: torch.Tensor) -> Prefix | None:
        """The memoised Prefix whose ``n_rows`` is this very tensor, or None."""
        for key, p in self._memo.items():
            if key[0] == "prefix" and isinstance(p, Prefix) and p.n_rows is n_rows:
                return p
        return None

    def compressed_address(self, groups: Groups, block_tables: torch.Tensor, block_size: int
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block, row, valid) of `groups`' entries in the paged pool (``blocks.compressed_row_address``)."""
        return self._cached(("address", groups.ratio, block_size),  # type: ignore[return-value]
                            lambda: compressed_row_address(block_tables, groups.seq, groups.j, groups.ratio,
                                                           block_size))

    def block_span(self, prefix: Prefix, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
        """The block-table columns holding `prefix`'s rows: ``block_tables[:, :n_blocks]``."""
        per_block = block_size // prefix.ratio
        n_blocks = min(-(-prefix.width // per_block), block_tables.shape[1])
        return self._cached(("span", prefix.ratio, block_size),  # type: ignore[return-value]
                            lambda: block_tables[:, :n_blocks])


def compressed_row_address(
    block_tables: torch.Tensor, seq: torch.Tensor, j: torch.Tensor, ratio: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Physical (block, row) of compressed row j of sequence seq, plus a validity mask.

    ``seq`` broadcasts against ``j``. Entries with ``j < 0`` (or past the table) are invalid and
    are addressed at (null block 0, row 0) so that they index nothing live; callers mask them.
    """
    valid = j >= 0
    jj = torch.where(valid, j, torch.zeros_like(j))
    pos = jj * ratio
    logical = pos // block_size
    valid = valid & (logical < block_tables.shape[1])
    logical = torch.where(valid, logical, torch.zeros_like(logical))
    seq_b, _ = torch.broadcast_tensors(seq, jj)
    block = block_tables[seq_b, logical]
    block = torch.where(valid, block, torch.zeros_like(block))
    row = torch.where(valid, (pos % block_size) // ratio, torch.zeros_like(pos))
    return block, row, valid
