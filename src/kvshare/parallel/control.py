"""Control plane of a tensor-parallel engine: rank 0 decides, workers replay.

Rank 0 runs the whole `LLMEngine` (scheduler, block manager, sampler, acceptor, proposer). Its
executor (parallel/tp_executor.py) broadcasts every executor operation as a `Step` before running
it: the operation (`Forward`: the plan's chunks in wire form, `WireSequence`s carrying only the
chunk's ids and the Engram look-back, plus the DSpark tap layers; `Draft`: the drafter's block
forward; `DraftContext`: the draft-window writes of the last forward's committed rows) and the slot
operations since the last message, in the order rank 0 applied them: a slot whose rings were
zeroed (an int), or a prefix hit's ring restore ``(slot, boundary, rings)`` with the checkpoint's
rows themselves (rank 0 alone keeps the checkpoint store; the hit's blocks already match, since
every rank wrote them in the same replayed forwards). A worker holds the same replicated cache (an
engine built from the same arguments, whose scheduler it never uses), applies the slot operations
and runs the same operation on its own executor (the model's collectives pair up with rank 0's).
Workers make no decision of their own, so they cannot diverge.

Rank 0 waits inside a step (a send, a forward's collectives) under a `StepWatchdog`: a worker
that makes no progress (stopped by SIGSTOP, hung in a kernel) would otherwise block rank 0 for
ever, since between steps workers legitimately wait on rank 0 without a timeout.

Other messages: ``"digest"`` (every rank returns a SHA-256 of its block pool and rings, gathered
on rank 0, to check the replicas) and ``"stop"`` (workers leave their loop). Messages travel with
``dist.broadcast_object_list`` as CPU tensors; each rank moves them to its own device.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from kvshare.engine.executor import Executor
from kvshare.engine.step_plan import ScheduledChunk

STOP = "stop"
DIGEST = "digest"

# A slot reset (the slot id) or a prefix hit's restore: (slot, boundary, checkpoint rings as
# `kvshare.cache.checkpoint.restore` takes them, on the CPU).
SlotOp = int | tuple[int, int, dict[tuple[str, int], tuple[int, int, torch.Tensor]]]


@dataclass
class Forward:
    """`Executor.forward` over `chunks` (wire form) recording `taps`."""

    chunks: list[ScheduledChunk]
    taps: tuple[int, ...]

    def apply(self, ex: Executor) -> None:
        tables = ex.runner.blocks.tables
        for c in self.chunks:  # this rank's block table mirrors rank 0's rows of the step's slots
            ids = c.seq.block_ids
            tables[c.seq.slot].zero_()
            tables[c.seq.slot, :len(ids)] = torch.tensor(ids, dtype=torch.int64, device=tables.device)
        ex.forward(self.chunks, self.taps)


@dataclass
class Draft:
    """`Executor.draft` (CPU tensors)."""

    anchors: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor

    def apply(self, ex: Executor) -> None:
        dev = ex.pool.device
        ex.draft(self.anchors.to(dev), self.positions.to(dev), self.slots.to(dev))


@dataclass
class DraftContext:
    """`Executor.write_draft_context`: the last forward's committed rows per chunk."""

    committed: list[int]

    def apply(self, ex: Executor) -> None:
        ex.write_draft_context(self.committed)


@dataclass
class Step:
    """One executor operation as rank 0 ran it, with the slot operations before it."""

    op: Forward | Draft | DraftContext
    slot_ops: list[SlotOp]  # in rank 0's order: a reset and a later restore of one slot must not swap
    threads: int  # rank 0's intra-op thread count: replicated maths must round alike on every rank


def send(message: Any) -> None:
    """Rank 0: broadcast one message to every worker."""
    dist.broadcast_object_list([message], src=0)


def receive() -> Any:
    """Worker: the next message from rank 0 (blocks until it comes)."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def pool_digest(pool: Any) -> str:
    """SHA-256 over the pool's block tensor and every ring (in key order)."""
    h = hashlib.sha256()
    tensors = [("blocks", pool.blocks)] + [(repr(k), pool.rings[k]) for k in sorted(pool.rings)]
    for name, t in tensors:
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def gather_digests(pool: Any, size: int) -> list[str]:
    """Every rank's `pool_digest`, in rank order (a collective: all ranks call it)."""
    out: list[Any] = [None] * size
    dist.all_gather_object(out, pool_digest(pool))
    return out


def apply_slot_ops(ex: Executor, ops: list[SlotOp]) -> None:
    """Apply rank 0's slot resets and ring restores to this rank's pool, in order."""
    for op in ops:
        if isinstance(op, int):
            ex.reset_slot(op)
        else:
            ex.restore(*op)


def worker_loop(ex: Executor, size: int) -> None:
    """Replay rank 0's operations on this worker's executor until rank 0 says stop."""
    while True:
        msg = receive()
        if msg == STOP:
            return
        if msg == DIGEST:
            gather_digests(ex.pool, size)
            continue
        if torch.get_num_threads() != msg.threads:
            torch.set_num_threads(msg.threads)
        apply_slot_ops(ex, msg.slot_ops)
        msg.op.apply(ex)


class StepWatchdog:
    """Calls `on_stall()` once when a guarded section (``with watchdog:``) lasts over `timeout_s`.

    One daemon thread watches every section of its owner, so entering and leaving cost a lock,
    not a thread. `on_stall` runs on that thread while the guarded call is still blocked; it must
    make that call fail (rank 0's handle kills the workers, which fails the pending collective).
    Invariant: `on_stall` runs at most once; `stalled_s` is the timeout it fired at (else None).
    """

    def __init__(self, timeout_s: float, on_stall: Callable[[], None]) -> None:
        if not timeout_s > 0:
            raise ValueError(f"tp_step_timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s = timeout_s
        self.on_stall = on_stall
        self.stalled_s: float | None = None
        self._deadline: float | None = None
        self._closed = False
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "StepWatchdog":
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="kvshare-tp-watchdog", daemon=True)
                self._thread.start()
            self._deadline = time.monotonic() + self.timeout_s
            self._cv.notify()
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._cv:
            self._deadline = None

    def close(self) -> None:
        """Stop watching (idempotent)."""
        with self._cv:
            self._closed = True
            self._cv.notify()

    def _watch(self) -> None:
        with self._cv:
            while not self._closed:
                if self._deadline is None:
                    self._cv.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cv.wait(left)
                    continue
                self._deadline = None
                self.stalled_s = self.timeout_s
                self._closed = True
        if self.stalled_s is not None:
            self.on_stall()
