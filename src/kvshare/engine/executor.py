"""Executor: the only caller of the model runner, the drafter's forward and the backend's end_step.

Everything that touches a rank's cache state goes through one of its operations, so a
tensor-parallel executor (parallel/tp_executor.py) can replay each on every worker, in order:

* ``reset_slot(slot)``: a recycled request slot's rings zeroed (spec/cache.md §9.6);
* ``restore(slot, boundary, rings)``: a prefix hit's checkpoint rows put back into the slot's rings;
* ``forward(chunks, taps)``: one model forward over the chunks (drafts appended), then the backend's
  end of step; returns the sampling chunks' logits rows and, when `taps` names DSpark target
  layers, their recorded input streams;
* ``draft(anchors, positions, slots)``: the DSpark drafter's block forward (speculation only);
* ``write_draft_context(committed)``: the draft windows' context rows of the last forward's
  committed tokens (its first ``committed[i]`` rows of chunk i).

Observers (prefix caching) see each forward: ``on_forward(chunks)`` is a context manager entered
around it, told whether the forward completed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, ContextManager, Iterator, Protocol

import torch

from kvshare.cache.checkpoint import restore
from kvshare.engine.model_runner import ModelRunner
from kvshare.engine.step_plan import ScheduledChunk
from kvshare.step import StepState


class ForwardObserver(Protocol):
    def on_forward(self, chunks: list[ScheduledChunk]) -> ContextManager[None]: ...


@dataclass
class Forward:
    """One forward's result: logits rows of the sampling chunks (`ModelRunner.run`), their chunk
    indices, and the taps (layer -> [T, D] over every row of the step) when asked for."""

    chunks: list[ScheduledChunk]
    logits: torch.Tensor
    sampling: list[int]
    taps: dict[int, torch.Tensor | None] = field(default_factory=dict)


class Executor:
    """Runs one rank's operations (see module doc) on its runner, pool and drafter."""

    def __init__(self, runner: ModelRunner, pool: Any, draft: Any = None, windows: Any = None) -> None:
        self.runner = runner
        self.backend = runner.backend
        self.pool = pool
        self.draft_model = draft  # model.dspark.DSparkDraft when speculating
        self.windows = windows  # its DraftWindows over this rank's pool
        self.observers: list[ForwardObserver] = []
        self._last: Forward | None = None

    @contextlib.contextmanager
    def using(self, runner: ModelRunner) -> Iterator[None]:
        """Run forwards through `runner` (a ModelRunner subclass over the same model and cache, e.g.
        the engine-eval scorer that also reads every prompt row) until the block exits."""
        saved, self.runner = self.runner, runner
        try:
            yield
        finally:
            self.runner = saved

    # ---- slot operations ------------------------------------------------------------------------
    def reset_slot(self, slot: int) -> None:
        with torch.inference_mode():
            self.pool.reset_slots(torch.tensor([slot], device=self.pool.device))

    def restore(self, slot: int, boundary: int, rings: dict) -> None:
        with torch.inference_mode():
            restore(self.pool, slot, boundary, rings)

    # ---- forwards -------------------------------------------------------------------------------
    def _observed(self, chunks: list[ScheduledChunk]) -> ContextManager[None]:
        if not self.observers:
            return contextlib.nullcontext()
        if len(self.observers) == 1:
            return self.observers[0].on_forward(chunks)
        stack = contextlib.ExitStack()
        for obs in self.observers:
            stack.enter_context(obs.on_forward(chunks))
        return stack

    def forward(self, chunks: list[ScheduledChunk], taps: tuple[int, ...] = ()) -> Forward:
        """One model forward over `chunks` and the end of the backend's step (see module doc)."""
        self._last = None
        state = StepState(taps={t: None for t in taps}) if taps else None
        with self._observed(chunks):
            try:
                # Called without `state` when there is none: ModelRunner.run(chunks) is the seam tests
                # and the engine-eval scorer wrap.
                logits, sampling = (self.runner.run(chunks) if state is None
                                    else self.runner.run(chunks, state))
            finally:
                with torch.inference_mode():
                    self.backend.end_step()  # deferred ring updates, inside inference mode like the rings
        out = Forward(chunks, logits, sampling, dict(state.taps) if state is not None else {})
        self._last = out
        return out

    @torch.inference_mode()
    def draft(self, anchors: torch.Tensor, positions: torch.Tensor,
              slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's block forward: (base logits U [N, B, vocab], x_head [N, B, D])."""
        return self.draft_model.block_forward(self.windows, anchors, positions, slots)

    @torch.inference_mode()
    def write_draft_context(self, committed: list[int]) -> None:
        """Draft windows get the context rows of the last forward's first ``committed[i]`` rows of
        each chunk i (its committed tokens)."""
        last = self._last
        if last is None:
            raise RuntimeError("write_draft_context: no completed forward this step")
        rows, slots, positions = [], [], []
        first = 0
        for c, n in zip(last.chunks, committed):
            rows.extend(range(first, first + n))
            slots.extend([c.seq.slot] * n)
            positions.extend(range(c.start, c.start + n))
            first += c.num_rows
        dev = self.pool.device
        idx = torch.tensor(rows, dtype=torch.int64, device=dev)
        main_x = self.draft_model.main_x({t: v.index_select(0, idx) for t, v in last.taps.items() if v is not None})
        self.draft_model.write_context(self.windows, main_x, torch.tensor(slots, dtype=torch.int64, device=dev),
                                       torch.tensor(positions, dtype=torch.int64, device=dev))
