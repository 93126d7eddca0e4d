"""The engine's side of prefix caching: admission hits, block registration, checkpoint capture.

One observer of the step pipeline: the scheduler calls ``lookup`` / ``adopt`` at admission and
``on_release`` when a sequence leaves the running set, the executor enters ``on_forward`` around
each forward, and the engine calls ``on_commit`` after the step's tokens are committed. With
prefix caching off the engine holds `NoPrefixCaching`, the same interface doing nothing.

Per request:

* Admission (``lookup`` then ``adopt``): the prompt's full blocks are hashed (salted), matched with
  their token ids checked, and the hit is the deepest boundary H of the matched chain that has a
  checkpoint, capped at ``floor((n - 1) / B) * B`` so at least one token computes logits. The slot
  takes the blocks of ``[0, H)`` (one reference each), its rings get the checkpoint's rows, and the
  scheduler computes ``[H, n)``. When blocks match deeper than any checkpoint, that depth is a
  *junction* (a prefix other requests share): this request captures a checkpoint there.
* Each step (``on_forward`` around each forward, then ``on_commit``): a sequence whose chunk
  crosses a block boundary captures
  the ring rows at its deepest boundary in the chunk (and at its junction); afterwards the newly
  full blocks are registered and the capture is staged. Only committed, computed tokens count:
  a capture at H is kept only if H is at most ``num_computed`` after the step and at most the
  sequence's token count (an accepted draft joins the ids only when appended), and blocks are
  hashed from the sequence's token ids, so speculative drafts never enter the cache.
* Commit: the staged capture becomes a checkpoint at the prompt's end and when the sequence leaves
  the running set (finish, abort, preemption), before its blocks are released.

``restore_hooks`` run after a hit with (sequence, H), for per-request state that is not in the
rings (for example an n-gram history, which the token ids ``[0, H)`` rebuild).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from kvshare.cache.blocks import BlockManager
from kvshare.cache.checkpoint import BoundaryCapture
from kvshare.cache.layout import CacheLayout
from kvshare.cache.pool import BlockPool
from kvshare.cache.prefix import Checkpoint, Match, PrefixCache, prefix_key
from kvshare.engine.outputs import EngineStats
from kvshare.engine.sequence import Sequence
from kvshare.engine.step_plan import ScheduledChunk

# (slot, boundary, checkpoint rings): puts a hit's ring rows back (the executor's ``restore``)
Restore = Callable[[int, int, dict], None]


class NoPrefixCaching:
    """Prefix caching off: no hits, no captures, nothing to register."""

    def lookup(self, seq: Sequence) -> None:
        return None

    def adopt(self, seq: Sequence, m: Match) -> None:
        raise RuntimeError("prefix caching is off: there is no hit to adopt")

    def on_forward(self, chunks: list[ScheduledChunk]) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    def on_commit(self, chunks: list[ScheduledChunk], final: bool = True) -> None:
        pass

    def on_release(self, seq: Sequence) -> None:
        pass

    def report(self, stats: EngineStats, blocks: BlockManager) -> None:
        pass


class PrefixCaching:
    def __init__(self, layout: CacheLayout, pool: BlockPool, blocks: BlockManager, backend: Any,
                 checkpoint_budget: int, model_id: str, dtype: torch.dtype, restore: Restore) -> None:
        cfg = layout.cfg
        key = prefix_key("kvshare-prefix-v1", model_id, repr(cfg), layout.layout_id, layout.window_format.label,
                         str(dtype), layout.block_size, cfg.sliding_window)
        self.cache = PrefixCache(layout.block_size, key, checkpoint_budget)
        self.pool, self.blocks, self.backend, self.restore = pool, blocks, backend, restore
        self.block_size = layout.block_size
        self.ratio_of = {p.layer: p.ratio for p in layout.topo.layers}
        blocks.allocator.is_cached = self.cache.is_cached
        blocks.allocator.on_evict = self.cache.drop_block
        self.restore_hooks: list[Callable[[Sequence, int], None]] = []
        self._captured: list[tuple[Sequence, int, BoundaryCapture | None, int]] = []
        self._pending: list[tuple[int, int]] = []

    # ---- hashing --------------------------------------------------------------------------------
    def _hashes(self, seq: Sequence, n_blocks: int) -> list[bytes]:
        known = seq.block_hashes
        if len(known) < n_blocks:
            tokens = seq.token_slice(len(known) * self.block_size, n_blocks * self.block_size)
            self.cache.hashes(tokens, known, n_blocks, seq.cache_salt)
        return known

    # ---- admission ------------------------------------------------------------------------------
    def lookup(self, seq: Sequence) -> Match:
        """The hit for a waiting sequence (no side effects on blocks or rings)."""
        b = self.block_size
        cap = (seq.num_tokens - 1) // b * b
        if seq.params.prompt_logprobs is not None:  # every prompt row must compute its logits
            cap = 0
        hashes = self._hashes(seq, cap // b)
        return self.cache.lookup(seq.token_slice(0, cap), hashes, cap, seq.cache_salt)

    def adopt(self, seq: Sequence, m: Match) -> None:
        """Admit with hit `m`: the slot (just opened, rings zeroed) takes its blocks and checkpoint."""
        st = self.cache.stats
        st.queried_tokens += seq.num_tokens
        st.hit_tokens += m.boundary
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = m.boundary
        seq.prefix_junction = m.block_depth if m.block_depth > m.boundary else 0
        if m.boundary == 0 or m.checkpoint is None:
            return
        assert seq.slot is not None
        self.blocks.adopt(seq.slot, m.blocks)
        seq.num_computed = m.boundary
        seq.num_registered = m.boundary // self.block_size
        self.restore(seq.slot, m.boundary, m.checkpoint.rings)
        for hook in self.restore_hooks:
            hook(seq, m.boundary)

    # ---- steps ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def on_forward(self, group: list[ScheduledChunk]) -> Iterator[None]:
        """Around one forward (a step may run its chunks in several groups, engine/isolation.py):
        capture its own targets; a forward that raises leaves no capture."""
        self.start_capture(group)
        ok = False
        try:
            yield
            ok = True
        finally:
            self.finish_capture(group, ok)

    def start_capture(self, group: list[ScheduledChunk]) -> None:
        """Arm the backend for one forward over `group` (drafted tokens included)."""
        targets = self._targets(group)
        self._pending = targets
        self.backend.capture = None if not targets else BoundaryCapture(
            [i for i, _ in targets], [h for _, h in targets], self.ratio_of, self.pool.device)

    def finish_capture(self, group: list[ScheduledChunk], ok: bool) -> None:
        """Disarm; keep the forward's captures only if it completed."""
        cap, self.backend.capture = self.backend.capture, None
        if ok:
            self._captured.extend((group[i].seq, h, cap, t) for t, (i, h) in enumerate(self._pending))
        self._pending = []

    def _targets(self, chunks: list[ScheduledChunk]) -> list[tuple[int, int]]:
        """(chunk index, boundary): each chunk's deepest block boundary inside it (its drafted tokens
        included: they are kept if accepted), and its junction."""
        b = self.block_size
        out = []
        for i, c in enumerate(chunks):
            s, e = c.start, c.start + c.num_rows
            out.extend((i, h) for h in sorted({e // b * b, c.seq.prefix_junction}) if s < h <= e)
        return out

    def on_commit(self, chunks: list[ScheduledChunk], final: bool = True) -> None:
        """After the step's forwards (``num_computed`` updated for the chunks that ran): register
        full blocks, stage captures, commit junctions and prompt ends. With ``final=False`` a capture
        whose boundary lies in accepted drafts not yet appended to the token ids waits for the next
        (final) call, made once they are."""
        captured, self._captured = self._captured, []
        for c in chunks:
            self._register(c.seq)
        for seq, h, cap, t in captured:
            if seq.slot is None or h > seq.num_computed:
                continue  # released since (failed, requeued), or not committed (a rejected draft)
            if h > seq.num_tokens:
                if not final:
                    self._captured.append((seq, h, cap, t))
                continue
            if h == seq.prefix_junction:
                self._commit(seq, h, cap, t)
                seq.prefix_junction = 0
            seq.staged_checkpoint = (h, cap, t)
        for c in chunks:
            p = len(c.seq.prompt_token_ids)
            if c.start < p <= c.start + c.length:
                self.commit(c.seq)

    def _register(self, seq: Sequence) -> None:
        b = self.block_size
        full = min(seq.num_computed, seq.num_tokens) // b  # computed blocks of known, committed ids
        if full <= seq.num_registered or seq.slot is None:
            return
        hashes = self._hashes(seq, full)
        ids = self.blocks.block_ids[seq.slot]
        tokens = seq.token_slice(seq.num_registered * b, full * b)
        for k in range(seq.num_registered, full):
            off = (k - seq.num_registered) * b
            self.cache.register(hashes[k], ids[k], tokens[off:off + b], seq.cache_salt)
        seq.num_registered = full

    # ---- checkpoints ----------------------------------------------------------------------------
    def commit(self, seq: Sequence) -> None:
        """Turn the staged capture into a checkpoint (prompt end, finish, abort, preemption)."""
        if seq.staged_checkpoint is not None:
            h, cap, t = seq.staged_checkpoint
            self._commit(seq, h, cap, t)

    def _commit(self, seq: Sequence, h: int, cap: BoundaryCapture | None, t: int) -> None:
        n = h // self.block_size
        hashes = self._hashes(seq, n)
        if cap is None or self.cache.has_checkpoint(hashes[n - 1]) or seq.slot is None:
            return
        # cap.rings holds every ring the forward read this step (the capture sits in history()); a
        # ring the forward never reads (a draft layer's window when no draft runs) holds nothing.
        ids = self.blocks.block_ids[seq.slot]
        for k in range(n):  # a chain block whose cached twin was evicted: register our own copy
            if hashes[k] not in self.cache.table:
                b = self.block_size
                self.cache.register(hashes[k], ids[k], seq.token_slice(k * b, (k + 1) * b), seq.cache_salt)
        self.cache.insert_checkpoint(Checkpoint(h, tuple(hashes[:n]), cap.rows_of(t)))

    def on_release(self, seq: Sequence) -> None:
        """The sequence leaves the running set: checkpoint it, then forget its per-slot bookkeeping."""
        self.commit(seq)
        seq.staged_checkpoint = None
        seq.num_registered = 0
        seq.prefix_junction = 0

    def report(self, stats: EngineStats, blocks: BlockManager) -> None:
        """Fill the prefix-cache fields of `stats`."""
        c = self.cache
        stats.prefix_cache_queried_tokens = c.stats.queried_tokens
        stats.prefix_cache_hit_tokens = c.stats.hit_tokens
        stats.prefix_cache_checkpoint_bytes = c.checkpoint_bytes
        stats.prefix_cache_checkpoints = len(c.checkpoints)
        stats.prefix_cache_evictable_blocks = blocks.allocator.num_evictable
