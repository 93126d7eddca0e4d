"""PagedBackend: the runtime.CacheBackend over a BlockPool, a step's block tables and slots.

Everything is batched tensor gathers / scatters over the whole step; no Python loop runs per token
or per sequence.

* ``history``: for each requested row (position p of sequence i) the window ``p-depth+1 .. p``;
  positions ``>= starts[i]`` come from this step's values, earlier ones from slot ``slots[i]``'s
  ring at ``q % rows`` (rows = depth + the layout's slack); ``q < 0`` is invalid (zeros, mask False).
  The ring update (the last ``rows`` positions of each sequence) is deferred to ``end_step`` (or
  the next step), so several calls for one (name, layer) in a step all read the pre-step ring.
* compressed rows: row j of sequence i with ratio r is at block ``block_tables[i, (j*r)//B]``,
  row ``((j*r) % B)//r`` (``blocks.compressed_row_address``). Invalid entries (j < 0, or past the
  table) are redirected to the null block 0 and masked to zeros on read; -1 never indexes.
* regions: ``write_rows(kind, L)`` stores the rows layer L computed into every view
  ``pool.write_views(kind, L)`` names; ``gather_*(kind, L)`` read ``pool.read_view(kind, L)``.
  The pool resolved both from the layout's RegionMap, so this backend has no notion of sharing.
"""

from __future__ import annotations

import torch

from kvshare.cache.blocks import compressed_row_address
from kvshare.cache.formats import RowFormat
from kvshare.cache.pool import BlockPool
from kvshare.cache.step_reads import StepReadCache
from kvshare.runtime import StepBatch


def _pack(fmt: RowFormat | None, x: torch.Tensor) -> torch.Tensor:
    return x if fmt is None else fmt.pack(x)  # state rows: the caller casts to the ring's dtype


def _unpack(fmt: RowFormat | None, x: torch.Tensor) -> torch.Tensor:
    return x if fmt is None else fmt.unpack(x)


class PagedBackend:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self._pending: list[tuple[torch.Tensor, RowFormat | None, torch.Tensor, torch.Tensor, torch.Tensor, int]] = []
        self._pending_keys: set[tuple[str, int]] = set()
        self._step: int | None = None
        self._reads = StepReadCache()
        self.capture = None  # a checkpoint.BoundaryCapture for the current step, set by the engine

    # ---- step boundaries -------------------------------------------------------------------------
    def _begin(self, batch: StepBatch) -> None:
        if self._step != id(batch):
            self.end_step()
            self._step = id(batch)

    def end_step(self) -> None:
        """Apply the deferred ring updates of the current step."""
        for ring, fmt, values, slot, pos, depth in self._pending:
            ring[slot, pos.remainder(depth)] = _pack(fmt, values).to(ring.dtype)
        self._pending.clear()
        self._pending_keys.clear()
        self._reads.clear()
        self._step = None

    # ---- history rings -----------------------------------------------------------------------------
    def history(self, name: str, layer: int, values: torch.Tensor, depth: int, batch: StepBatch,
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        self._begin(batch)
        ring, fmt = self.pool.ring(name, layer, depth, values.shape[-1])
        phys = ring.shape[1]  # >= depth: slack rows keep rejected speculative rows off live ones
        t_all = values.shape[0]
        if rows is None:
            rows = torch.arange(t_all, device=values.device)
        seq = batch.seq_index[rows]
        p = batch.positions[rows]
        q = p[:, None] - depth + 1 + torch.arange(depth, device=p.device)[None, :]  # [R, depth]
        start = batch.starts[seq][:, None]
        valid = q >= 0
        in_step = q >= start
        step_row = (batch.cu_seqlens[seq][:, None] + q - start).clamp(0, max(t_all - 1, 0))
        if bool((valid & ~in_step).any()):
            # Unpack each sequence's ring once ([N, depth, w]), then index it per requested row.
            rings = _unpack(fmt, ring.index_select(0, batch.slots)).to(values.dtype)
            stored = rings[seq[:, None].expand_as(q), q.remainder(phys)]
            out = torch.where(in_step[..., None], values[step_row], stored)
            out = out.masked_fill(~valid[..., None], 0)
        else:  # every valid position is in this step (prompts from position 0): one gather, same values
            out = values[step_row]
            if not bool(valid.all()):
                out = out.masked_fill_(~valid[..., None], 0)
        key = (name, layer)
        if key not in self._pending_keys:
            if self.capture is not None:  # prefix caching: ring rows at a block boundary (cache/checkpoint.py)
                self.capture.take(name, layer, ring, fmt, values, depth, batch)
            self._pending_keys.add(key)
            keep = batch.positions >= (batch.ends - phys)[batch.seq_index]
            idx = keep.nonzero().squeeze(1)
            self._pending.append((ring, fmt, values[idx], batch.slots[batch.seq_index[idx]],
                                  batch.positions[idx], phys))
        return out, valid

    # ---- compressed rows ------------------------------------------------------------------------------
    def _address(self, layer: int, seq: torch.Tensor, index: torch.Tensor, batch: StepBatch):
        if batch.block_tables is None:
            raise ValueError("the paged backend needs batch.block_tables")
        while seq.dim() < index.dim():
            seq = seq.unsqueeze(-1)
        return compressed_row_address(batch.block_tables, seq, index, self.pool.ratio(layer), self.block_size)

    def write_rows(self, kind: str, layer: int, seq: torch.Tensor, index: torch.Tensor, values: torch.Tensor,
                   batch: StepBatch) -> None:
        self._begin(batch)
        targets = self.pool.write_views(kind, layer)
        if index.numel() == 0:
            return
        block, row, _ = self._address(layer, seq, index, batch)  # invalid -> null block 0
        packed = self.pool.formats[kind].pack(values)
        for view in targets:  # one view when sharing; every copy when not
            view[block, row] = packed
            self._reads.invalidate(view)

    def gather_rows(self, kind: str, layer: int, seq: torch.Tensor, index: torch.Tensor,
                    batch: StepBatch) -> torch.Tensor:
        self._begin(batch)
        view = self.pool.read_view(kind, layer)
        hit = self._reads.get(view, "rows", index, seq)
        if hit is not None:
            return hit
        block, row, valid = self._address(layer, seq, index, batch)
        rows = self.pool.formats[kind].unpack(view[block, row]).to(self.pool.dtype)
        rows = rows.masked_fill(~valid[..., None], 0)
        self._reads.put(view, "rows", index, seq, rows)
        return rows

    def gather_prefix(self, kind: str, layer: int, n_rows: torch.Tensor,
                      batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [0, n_rows[i]) of every sequence, read by whole blocks: the block table picks each
        sequence's blocks and the [blocks, rows per block] view flattens to its row order
        (row j sits at logical block j // (B / r), row j % (B / r)); rows past n_rows are zeros."""
        self._begin(batch)
        if batch.block_tables is None:
            raise ValueError("the paged backend needs batch.block_tables")
        n = n_rows.shape[0]
        width = int(n_rows.max()) if n else 0
        mask = torch.arange(width, device=n_rows.device)[None, :] < n_rows[:, None]
        view = self.pool.read_view(kind, layer)
        hit = self._reads.get(view, "prefix", n_rows, batch.block_tables)
        if hit is not None:
            return hit, mask
        per_block = view.shape[1]  # block_size // ratio rows
        n_blocks = min(-(-width // per_block), batch.block_tables.shape[1])
        tables = batch.block_tables[:, :n_blocks]
        rows = view[tables].reshape(n, n_blocks * per_block, view.shape[-1])[:, :width]
        if rows.shape[1] < width:  # rows past the table (never for a valid batch): zeros
            rows = torch.cat([rows, rows.new_zeros(n, width - rows.shape[1], rows.shape[-1])], dim=1)
        out = self.pool.formats[kind].unpack(rows).to(self.pool.dtype).masked_fill(~mask[..., None], 0)
        self._reads.put(view, "prefix", n_rows, batch.block_tables, out)
        return out, mask
