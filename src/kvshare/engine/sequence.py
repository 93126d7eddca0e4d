"""Sequence: one request's tokens, progress and lifecycle.

State machine::

    WAITING --schedule--> RUNNING --finish--> FINISHED_STOPPED | FINISHED_LENGTH
       ^                     |  \\--abort--> FINISHED_ABORTED  (also from WAITING)
       |                     |  \\--fails alone in a step--> FINISHED_ERROR (``error`` says why)
       +----preempt----------+

Invariants:

* ``tokens = prompt_token_ids + output_token_ids``; ``num_computed <= len(tokens)``.
* The KV of positions ``[0, num_computed)`` is in the cache (blocks + the slot's rings) iff the
  sequence is RUNNING; a WAITING sequence has no slot and no blocks and ``num_computed == 0``.
* A step that brings ``num_computed`` to ``len(tokens)`` samples the next token. Prefill,
  chunked prefill, decode and recompute after preemption are all the same rule.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvshare.engine.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                        SequenceStatus.FINISHED_ABORTED, SequenceStatus.FINISHED_ERROR)


@dataclass
class RequestMetrics:
    """Wall-clock times (time.perf_counter seconds) of a request's milestones."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(eq=False)
class Sequence:
    """One request inside the engine."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_order: int
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # logprobs.py: per output token its top-k alternatives (when asked); per prompt position its logprob
    output_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that finished it (None: eos/length)
    output_text: str = ""
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0
    slot: int | None = None
    detok: object | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.perf_counter()))
    new_token_ids: list[int] = field(default_factory=list)
    error: str | None = None  # why the request failed (status FINISHED_ERROR)
    # prefix caching (engine/prefix_caching.py): salt, tokens served from the cache at first admission,
    # hashes of full blocks, how many of this slot's blocks are registered, a junction to checkpoint,
    # and the latest ring capture at a block boundary (boundary, capture, target index)
    cache_salt: str | None = None
    num_cached_tokens: int | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered: int = 0
    prefix_junction: int = 0
    staged_checkpoint: tuple | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``tokens[start:end]`` without building the whole token list (O(end - start))."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_token(self, token: int, logprob: float, top: dict[int, float] | None = None) -> None:
        self.output_token_ids.append(token)
        self.output_logprobs.append(logprob)
        if top is not None:
            self.output_top_logprobs.append(top)
        self.new_token_ids.append(token)

    def reset_for_recompute(self) -> None:
        """Preempted: drop the cache state; the prompt plus generated tokens are recomputed."""
        self.num_computed = 0
        self.slot = None
        self.status = SequenceStatus.WAITING
        self.metrics.num_preemptions += 1
