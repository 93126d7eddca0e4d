"""Rank 0's executor of a tensor-parallel engine: each operation is broadcast, then run locally.

Same operations as `engine.executor.Executor`; before running one, rank 0 sends it to the
workers (parallel/control.py) with the slot operations (resets, prefix restores) applied since the
last message, so every rank replays the same sequence of cache writes and collectives. A forward's
chunks travel in wire form (`ScheduledChunk.wire`: the chunk's ids, the Engram look-back and the
slot's block-table row).
Any failure, local or remote, stops the group (`TPHandle.guard` raises an engine-fatal error):
the replicas could no longer be trusted to agree.
"""

from __future__ import annotations

from typing import Any

import torch

from kvshare.engine.executor import Executor, Forward
from kvshare.engine.step_plan import ScheduledChunk
from kvshare.parallel import control


class TPExecutor(Executor):
    def __init__(self, handle: Any, runner: Any, pool: Any, draft: Any = None, windows: Any = None) -> None:
        super().__init__(runner, pool, draft, windows)
        self.handle = handle
        self.lookback = int(getattr(runner.model, "engram_lookback", 0))
        self._ops: list[control.SlotOp] = []  # slot resets and prefix restores since the last message

    def _send(self, op: Any) -> None:
        step = control.Step(op, self._ops, torch.get_num_threads())
        self._ops = []
        self.handle.guard(control.send, step)

    def reset_slot(self, slot: int) -> None:
        self._ops.append(slot)
        super().reset_slot(slot)

    def restore(self, slot: int, boundary: int, rings: dict) -> None:
        super().restore(slot, boundary, rings)
        self._ops.append((slot, boundary, {k: (d, w, r.cpu()) for k, (d, w, r) in rings.items()}))

    def forward(self, chunks: list[ScheduledChunk], taps: tuple[int, ...] = ()) -> Forward:
        blocks = self.runner.blocks
        wire = [c.wire(self.lookback, blocks.block_ids[c.seq.slot][:blocks.blocks_needed(c.start + c.num_rows)])
                for c in chunks]
        self._send(control.Forward(wire, taps))
        return self.handle.guard(super().forward, chunks, taps)

    def draft(self, anchors: torch.Tensor, positions: torch.Tensor,
              slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._send(control.Draft(anchors.cpu(), positions.cpu(), slots.cpu()))
        return self.handle.guard(super().draft, anchors, positions, slots)

    def write_draft_context(self, committed: list[int]) -> None:
        self._send(control.DraftContext(list(committed)))
        self.handle.guard(super().write_draft_context, committed)
