"""PagedBackend: the runtime.CacheBackend over a BlockPool, a step's block tables and slots.

Everything is batched tensor gathers / scatters over the whole step; no Python loop runs per token
or per sequence.

* addresses: the step's `StepAddresses` (``begin_step``, or bound on the first call with a new
  batch) give every ring read / write, compressed-entry address and prefix width, computed once per
  step; nothing here reads a device value on the host when the model asks with the addresses' own
  tensors (an arbitrary `n_rows` tensor in ``gather_prefix`` costs one host read).
* ``history``: for each requested row (position p of sequence i) the window ``p-depth+1 .. p``;
  positions ``>= starts[i]`` come from this step's values, earlier ones from slot ``slots[i]``'s
  `Ring` (cache/rings.py; rows = depth + the layout's slack); ``q < 0`` is invalid (zeros, mask
  False). The ring update (the last ``rows`` positions of each sequence) is deferred to
  ``end_step`` (or the next step), so several calls for one (name, layer) in a step all read the
  pre-step ring.
* compressed rows: row j of sequence i with ratio r is at block ``block_tables[i, (j*r)//B]``,
  row ``((j*r) % B)//r`` (``blocks.compressed_row_address``). Invalid entries (j < 0, or past the
  table) are redirected to the null block 0 and masked to zeros on read; -1 never indexes.
* regions: ``write_rows(kind, L)`` stores the rows layer L computed into every view
  ``pool.write_views(kind, L)`` names; ``gather_*(kind, L)`` read ``pool.read_view(kind, L)``.
  The pool resolved both from the layout's RegionMap, so this backend has no notion of sharing.
"""

from __future__ import annotations

import torch

from kvshare.cache.formats import DECODED_DTYPES
from kvshare.cache.in_place import PoolKeys, WindowKeys
from kvshare.cache.pool import BlockPool
from kvshare.cache.rings import Ring, write_all
from kvshare.cache.step_reads import StepReadCache
from kvshare.step import StepBatch
from kvshare.step.addresses import StepAddresses, compressed_row_address


class PagedBackend:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self._pending: list[tuple[Ring, torch.Tensor]] = []
        self._pending_keys: set[tuple[str, int]] = set()
        self._addr: StepAddresses | None = None
        self._reads = StepReadCache()
        self.capture = None  # a checkpoint.BoundaryCapture for the current step, set by the engine

    # ---- step boundaries -------------------------------------------------------------------------
    def begin_step(self, addresses: StepAddresses, capture=None) -> None:  # noqa: ANN001
        """Bind this step's addresses (and a prefix checkpoint capture, if any); a step still open
        is ended first. The addresses every step uses (ring updates, completed groups, prefix
        widths and paged addresses per ratio) are built now, before the layers; reads whose rows
        depend on the attention path a layer takes are built by their first reader."""
        if self._addr is not None:
            self.end_step()
        self._addr = addresses
        if capture is not None:
            self.capture = capture
        tables = addresses.batch.block_tables
        for r in self.pool.topo.ratios_in_use:
            groups, prefix = addresses.groups(r), addresses.prefix(r)
            if tables is not None:
                if groups.count:  # (a decode step mostly completes no group: nothing to address)
                    addresses.compressed_address(groups, tables, self.block_size)
                addresses.block_span(prefix, tables, self.block_size)
        for rows in sorted({t.shape[1] for t in self.pool.rings.values()}):
            addresses.ring_write(rows)

    def _bound(self, batch: StepBatch) -> StepAddresses:
        """The step's addresses; a call with another batch than the bound one starts its step."""
        addr = self._addr
        if addr is None or addr.batch is not batch:
            addr = batch.addresses()
            self.begin_step(addr)
        return addr

    def end_step(self) -> None:
        """Apply the deferred ring updates of the current step, per ring row count (`write_all`: plain
        rows of every ring copied in one native call, other rings of one encoding packed together)."""
        addr = self._addr
        same: dict[int, list[tuple[Ring, torch.Tensor]]] = {}
        for ring, values in self._pending:
            same.setdefault(ring.rows, []).append((ring, values))
        for rows, items in same.items():
            assert addr is not None
            write_all([r for r, _ in items], addr.ring_write(rows), [v for _, v in items])
        self._pending.clear()
        self._pending_keys.clear()
        self._reads.clear()
        self._addr = None

    def draft_window(self, layer: int, width: int, dtype: torch.dtype) -> Ring:
        """The DSpark draft stage `layer`'s window ring (planned by the layout, packed rows)."""
        return self.pool.ring("window", layer, None, width)

    # ---- history rings -----------------------------------------------------------------------------
    def history(self, name: str, layer: int, values: torch.Tensor, depth: int, batch: StepBatch,
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        addr = self._bound(batch)
        ring = self.pool.ring(name, layer, depth, values.shape[-1])
        read = addr.ring_read(rows, depth, ring.rows)
        out = ring.window(read, values)
        self._defer(name, layer, ring, values, batch)
        return out, read.valid

    def remember(self, name: str, layer: int, values: torch.Tensor, depth: int, batch: StepBatch) -> None:
        """`history`'s deferred ring update alone (no read)."""
        self._bound(batch)
        self._defer(name, layer, self.pool.ring(name, layer, depth, values.shape[-1]), values, batch)

    def window_keys(self, name: str, layer: int, values: torch.Tensor, depth: int,
                    batch: StepBatch, decode: bool = False, reader_decodes: bool = False) -> WindowKeys | None:
        """`history` for every token row without the gather: the ring's stored bytes and the step's
        row facts, for a kernel that reads them in place (cache/in_place.py), where the ring's rows
        are plain values of `values`' dtype; else, with `decode`, quantised rows decoded once, the
        step's slots only (N x ring rows, not T x depth gathered rows), into a ring copy read by
        sequence (`StepAddresses.window_meta`); else, with `reader_decodes` (a kernel that decodes
        the native FP8 / FP4 schemes itself), the stored rows and their `RowFormat.codec`; else None
        (the caller then asks `history`). The ring update is deferred exactly as `history` defers it."""
        ring = self.pool.ring(name, layer, depth, values.shape[-1])
        if ring.fmt is None:
            return None
        plain = ring.fmt.plain_dtype == values.dtype
        coded = reader_decodes and ring.fmt.codec is not None and values.dtype in DECODED_DTYPES
        if not (plain or decode or coded):
            return None
        addr = self._bound(batch)
        self._defer(name, layer, ring, values, batch)
        if plain:
            return WindowKeys(ring.data, values, addr.window_meta(), depth)
        if decode:
            rows = ring.unpack(ring.data[batch.slots], values.dtype)  # [N, ring rows, width]
            return WindowKeys(rows.view(torch.uint8), values, addr.window_meta(by_sequence=True), depth)
        return WindowKeys(ring.data, values, addr.window_meta(), depth, ring.fmt.codec)

    def _defer(self, name: str, layer: int, ring: Ring, values: torch.Tensor, batch: StepBatch) -> None:
        """Queue the ring update of this step's `values` (once per (name, layer) and step)."""
        key = (name, layer)
        if key not in self._pending_keys:
            if self.capture is not None:  # prefix caching: ring rows at a block boundary (cache/checkpoint.py)
                self.capture.take(name, layer, ring, values, batch)
            self._pending_keys.add(key)
            self._pending.append((ring, values))

    # ---- compressed rows ------------------------------------------------------------------------------
    def _tables(self, batch: StepBatch) -> torch.Tensor:
        if batch.block_tables is None:
            raise ValueError("the paged backend needs batch.block_tables")
        return batch.block_tables

    def write_rows(self, kind: str, layer: int, seq: torch.Tensor, index: torch.Tensor, values: torch.Tensor,
                   batch: StepBatch) -> None:
        addr = self._bound(batch)
        targets = self.pool.write_views(kind, layer)
        if index.numel() == 0:
            return
        tables, ratio = self._tables(batch), self.pool.ratio(layer)
        groups = addr.groups(ratio)
        if index is groups.j:  # the step's own entries: addressed once per step and ratio
            block, row, _ = addr.compressed_address(groups, tables, self.block_size)
        else:
            block, row, _ = compressed_row_address(tables, _lift(seq, index), index, ratio, self.block_size)
        packed = self.pool.formats[kind].pack(values)
        for view in targets:  # one view when sharing; every copy when not
            view[block, row] = packed
            self._reads.invalidate(view)

    def pool_keys(self, kind: str, layer: int, dtype: torch.dtype, batch: StepBatch,
                  decode: bool = False, reader_decodes: bool = False) -> PoolKeys | None:
        """The region layer `layer` reads, in place (cache/in_place.py), where its rows are plain
        values of `dtype`; else, with `decode`, quantised rows decoded once into a copy of the blocks
        holding the step's prefix rows (``StepAddresses.prefix``: every row a causal reader may
        reach), with block tables of that copy (layers reading one region in a step share the copy:
        StepReadCache); else, with `reader_decodes` (see `window_keys`), the stored rows and their
        `RowFormat.codec`; else None (the caller then gathers with `gather_rows`)."""
        fmt = self.pool.formats[kind]
        plain = fmt.plain_dtype == dtype
        coded = reader_decodes and fmt.codec is not None and dtype in DECODED_DTYPES
        if not (plain or (decode and dtype in DECODED_DTYPES) or coded):
            return None
        addr = self._bound(batch)
        tables, ratio, view = self._tables(batch), self.pool.ratio(layer), self.pool.read_view(kind, layer)
        if plain:
            return PoolKeys(view, tables, ratio, self.block_size)
        if not decode:
            return PoolKeys(view, tables, ratio, self.block_size, fmt.codec)
        span = addr.block_span(addr.prefix(ratio), tables, self.block_size)  # [N, C]
        n, c = span.shape
        if c == 0:
            return None
        rows = self._reads.get(view, "decoded", span, tables)
        if rows is None:
            rows = fmt.unpack(view[span], dtype).view(n * c, view.shape[1], -1).view(torch.uint8)
            self._reads.put(view, "decoded", span, tables, rows)
        local = torch.arange(n * c, device=tables.device, dtype=tables.dtype).view(n, c)
        return PoolKeys(rows, local, ratio, self.block_size)

    def gather_rows(self, kind: str, layer: int, seq: torch.Tensor, index: torch.Tensor,
                    batch: StepBatch) -> torch.Tensor:
        self._bound(batch)
        view = self.pool.read_view(kind, layer)
        hit = self._reads.get(view, "rows", index, seq)
        if hit is not None:
            return hit
        block, row, valid = compressed_row_address(self._tables(batch), _lift(seq, index), index,
                                                   self.pool.ratio(layer), self.block_size)
        rows = self.pool.formats[kind].unpack(view[block, row], self.pool.dtype)
        rows = rows.masked_fill(~valid[..., None], 0)
        self._reads.put(view, "rows", index, seq, rows)
        return rows

    def gather_prefix(self, kind: str, layer: int, n_rows: torch.Tensor,
                      batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [0, n_rows[i]) of every sequence, read by whole blocks: the block table picks each
        sequence's blocks and the [blocks, rows per block] view flattens to its row order
        (row j sits at logical block j // (B / r), row j % (B / r)); rows past n_rows are zeros.
        `n_rows` from ``batch.addresses().prefix(r)`` needs no host read; any other tensor one."""
        addr = self._bound(batch)
        tables = self._tables(batch)
        pre = addr.prefix_of(n_rows)
        if pre is None:
            width = int(n_rows.max()) if n_rows.shape[0] else 0
            mask = torch.arange(width, device=n_rows.device)[None, :] < n_rows[:, None]
            per_block = self.block_size // self.pool.ratio(layer)
            span = tables[:, :min(-(-width // per_block), tables.shape[1])]
        else:
            width, mask = pre.width, pre.mask
            span = addr.block_span(pre, tables, self.block_size)
        view = self.pool.read_view(kind, layer)
        hit = self._reads.get(view, "prefix", n_rows, tables)
        if hit is not None:
            return hit, mask
        n = n_rows.shape[0]
        rows = view[span].reshape(n, span.shape[1] * view.shape[1], view.shape[-1])[:, :width]
        if rows.shape[1] < width:  # rows past the table (never for a valid batch): zeros
            rows = torch.cat([rows, rows.new_zeros(n, width - rows.shape[1], rows.shape[-1])], dim=1)
        out = self.pool.formats[kind].unpack(rows, self.pool.dtype).masked_fill(~mask[..., None], 0)
        self._reads.put(view, "prefix", n_rows, tables, out)
        return out, mask


def _lift(seq: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`seq` with trailing unit dims so it broadcasts against `index`."""
    while seq.dim() < index.dim():
        seq = seq.unsqueeze(-1)
    return seq
