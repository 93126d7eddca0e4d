"""Continuous-batching scheduler: token budget, chunked prefill, decode batching, preemption.

Each step gives every scheduled sequence one chunk ``[num_computed, num_computed + length)`` of its
tokens; a chunk that reaches the end of the sequence's tokens produces a sampled token. Decodes are
chunks of length 1; prompts are split into chunks when the step's token budget
(``max_num_batched_tokens``) runs out, so prefill and decode mix in one batch.

Policy (FCFS, oldest first):

1. Running sequences, oldest first, take their next chunk within the budget. When the pool has too
   few free blocks, a prefill chunk is shortened to what fits; if nothing fits, the newest running
   sequence is preempted (blocks and slot freed, requeued to recompute from its prompt plus
   generated tokens) until it does. The oldest sequence therefore always progresses.
2. Waiting sequences, oldest first, are admitted while the budget, ``max_num_seqs`` (request slots)
   and free blocks allow. Admission never preempts. With prefix caching (``prefix``), a sequence is
   admitted at its hit boundary H (blocks and checkpoint adopted) and computes ``[H, n)``.

Fairness (issue 36):

* Fair steps (with chunked prefill): while any running sequence is decoding (one token left to compute), the prefill
  chunks of a step share at most ``prefill_tokens_with_decodes`` tokens (None: no cap, the offline
  default, for throughput; `kvshare serve` sets `PREFILL_TOKENS_WITH_DECODES`), so a long prompt is
  spread over steps that each stay short and running decodes keep their pace; a step without
  decodes still takes the whole ``max_num_batched_tokens``.
* Groups: sequences with the same ``group`` (the server sets it to the HTTP request's id, so the n
  choices x prompts of one request are one group; a sequence without one is its own group) are
  admitted round-robin — the waiting sequence whose group holds the fewest running sequences goes
  first, oldest first among equals — and a group is admitted only while it holds fewer than its
  share, min(``group_cap``, max_num_seqs // the number of groups with work), where ``group_cap`` =
  max_num_seqs - max(1, max_num_seqs // 8): alone, an n=256 request fills all but the reserve; beside
  6 streams it takes its seventh, so it neither holds every slot while a new client waits nor
  slows the streams by multiplying the batch. Nothing is preempted for fairness: a group over its
  share (it came first) just takes no new slot until its sequences finish. Without groups (every
  sequence its own) this is the FCFS order above.

Invariants: a scheduled chunk has length >= 1; the blocks for ``num_computed + length`` tokens are
allocated before the step runs; the total scheduled tokens are <= ``max_num_batched_tokens``.
"""

from __future__ import annotations

import bisect
import time
from typing import Any

from kvshare.cache.blocks import BlockManager
from kvshare.engine.prefix_caching import NoPrefixCaching
from kvshare.engine.sequence import Sequence, SequenceStatus
from kvshare.engine.step_plan import ScheduledChunk, StepPlan

__all__ = ["Scheduler", "ScheduledChunk", "StepPlan", "SchedulerOutput"]

# Prefill tokens per step while decodes run. Measured on the shipped model, 1 thread, 6 decodes
# (median step), quiet machine: decodes alone 9.8 ms; + 8 prefill tokens 13.7 ms; + 12: 15.3 ms;
# + 16: 17.0 ms; + 32: 26.0 ms (loaded, load ~9: 27 ms alone, + 16: 49 ms, + 192: 243 ms; 2,048 gave
# victims 2.3 s gaps). 12 keeps the decodes above half their rate (the target, with the
# server's own overhead on top) while a long prompt prefills beside them, at ~0.8 prefill tokens
# per ms (~0.9 alone). The server's default (`kvshare serve`); offline engines take no cap.
PREFILL_TOKENS_WITH_DECODES = 12


def group_of(seq: Sequence) -> str:
    """The admission group of `seq`: its `group` attribute when set, else its own request id."""
    return getattr(seq, "group", None) or seq.request_id


# The plan's types live in step_plan.py; ``SchedulerOutput`` is the plan's former name.
SchedulerOutput = StepPlan


class Scheduler:
    """Owns the waiting queue and the running list; allocates blocks and slots through BlockManager."""

    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked_prefill: bool = True, prefix: Any = None) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.blocks = blocks
        self.max_num_seqs = min(max_num_seqs, blocks.slots.num_slots)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: list[Sequence] = []  # sorted by arrival_order
        self.running: list[Sequence] = []  # sorted by arrival_order
        self.num_preemptions = 0
        self.prefill_tokens_with_decodes: int | None = None  # (EngineArgs.prefill_tokens_with_decodes)
        self.group_cap = max(1, self.max_num_seqs - max(1, self.max_num_seqs // 8))
        # engine/prefix_caching.PrefixCaching, or its null object when prefix caching is off
        self.prefix = prefix if prefix is not None else NoPrefixCaching()

    # ---- queue management -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        keys = [s.arrival_order for s in self.waiting]
        self.waiting.insert(bisect.bisect(keys, seq.arrival_order), seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Mark `seq` finished (stop, length or abort) and free its blocks and slot."""
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = status
        seq.metrics.finished_time = time.perf_counter()

    def _release(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self.prefix.on_release(seq)  # checkpoint while the blocks are still held
            self.blocks.release(seq.slot)
            seq.slot = None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.reset_for_recompute()
        self._enqueue(seq)
        self.num_preemptions += 1

    # ---- one step ---------------------------------------------------------------------------
    def _fit(self, seq: Sequence, want: int, hit=None) -> int:
        """Longest chunk <= want whose blocks are allocatable now (0 if none); `hit`: a prefix match
        the sequence would adopt (its blocks are held, its evictable ones are no longer free)."""
        free = self.blocks.allocator.num_free
        if hit is not None and hit.boundary:
            evictable = sum(self.blocks.allocator.refcount(b) == 0 for b in hit.blocks)
            return max(0, min(want, (free - evictable) * self.blocks.block_size))
        have = len(self.blocks.block_ids.get(seq.slot, [])) if seq.slot is not None else 0
        cap = (have + free) * self.blocks.block_size - seq.num_computed
        return max(0, min(want, cap))

    def schedule(self) -> StepPlan:
        out = StepPlan()
        budget = self.max_num_batched_tokens
        decoding = any(s.num_uncomputed == 1 for s in self.running)
        share = self.prefill_tokens_with_decodes
        prefill_left = min(budget, share) if decoding and self.chunked_prefill and share is not None else budget
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            prefill = seq.num_uncomputed > 1
            want = min(seq.num_uncomputed, budget, prefill_left if prefill else budget)
            if want == 0:  # a prefill past this step's share: it goes on next step
                i += 1
                continue
            n = self._fit(seq, want)
            while n < want and (n == 0 or not self.chunked_prefill):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
                n = self._fit(seq, want)
            if seq.status is not SequenceStatus.RUNNING:
                continue  # seq preempted itself; the list shifted
            self.blocks.grow(seq.slot, seq.num_computed + n)  # type: ignore[arg-type]
            out.chunks.append(ScheduledChunk(seq, seq.num_computed, n))
            budget -= n
            if prefill:
                prefill_left -= n
            i += 1

        counts: dict[str, int] = {}
        for s in self.running:
            counts[group_of(s)] = counts.get(group_of(s), 0) + 1
        groups = len(set(counts) | {group_of(s) for s in self.waiting})
        cap = min(self.group_cap, max(1, self.max_num_seqs // max(1, groups)))
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self._next_waiting(counts, cap)
            if seq is None or seq in out.preempted:
                break  # do not readmit a victim in the step that evicted it
            hit = self.prefix.lookup(seq)
            todo = seq.num_tokens - (hit.boundary if hit is not None else 0)
            want = min(todo, budget, prefill_left if todo > 1 else budget)
            if want == 0:
                break
            if not self.chunked_prefill and want < todo:
                break
            n = self._fit(seq, want, hit)
            if n < want and (n == 0 or not self.chunked_prefill):
                break
            self.waiting.remove(seq)
            counts[group_of(seq)] = counts.get(group_of(seq), 0) + 1
            seq.slot = self.blocks.open_slot()
            seq.status = SequenceStatus.RUNNING
            if hit is not None:
                self.prefix.adopt(seq, hit)
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.perf_counter()
            self.blocks.grow(seq.slot, seq.num_computed + n)
            bisect.insort(self.running, seq, key=lambda s: s.arrival_order)
            out.chunks.append(ScheduledChunk(seq, seq.num_computed, n))
            budget -= n
            if todo > 1:
                prefill_left -= n
        return out

    def _next_waiting(self, counts: dict[str, int], cap: int) -> Sequence | None:
        """The waiting sequence to admit next: of the groups under `cap`, the one holding the fewest
        running sequences; the oldest of it (None when every waiting group is at its cap)."""
        best, best_count = None, None
        for seq in self.waiting:
            c = counts.get(group_of(seq), 0)
            if c >= cap or (best_count is not None and c >= best_count):
                continue
            best, best_count = seq, c
            if c == 0:
                break
        return best

    def requeue(self, seq: Sequence) -> None:
        """Drop a running sequence's cache state and queue it to recompute (after a failed step)."""
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq)
            seq.reset_for_recompute()  # counted in the request's num_preemptions, not the scheduler's
            self._enqueue(seq)

    def abort(self, request_id: str) -> Sequence | None:
        for seq in self.running + self.waiting:
            if seq.request_id == request_id:
                self.finish(seq, SequenceStatus.FINISHED_ABORTED)
                return seq
        return None
