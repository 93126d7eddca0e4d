"""StepPlan: what one engine step computes, as the scheduler decided it.

A plan is a list of `ScheduledChunk`s (each: tokens ``[start, start + length)`` of one sequence,
then the speculative ``draft`` tokens the proposer appended) plus the sequences preempted to make
room. The scheduler emits it; the proposer fills the drafts; the executor runs it (locally, or
broadcast to the tensor-parallel workers as `wire` chunks); the acceptor turns its logits rows
into committed tokens.

Invariants: ``length >= 1``; ``draft`` is empty unless the chunk is a decode (see `is_decode`);
a chunk's logits rows are its last ``1 + len(draft)`` rows (row j follows the j-th draft).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from kvshare.engine.sequence import Sequence


@dataclass
class ScheduledChunk:
    """Tokens ``[start, start + length)`` of `seq`, then `draft` (speculative tokens to verify, not
    part of the sequence; ``length`` does not count them)."""

    seq: Sequence | "WireSequence"
    start: int
    length: int
    draft: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's last token (and so yields a new token)."""
        return self.start + self.length == self.seq.num_tokens

    @property
    def is_decode(self) -> bool:
        """One generated token left to compute (the anchor of a speculative step)."""
        return self.samples and self.length == 1 and self.start >= len(self.seq.prompt_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_slice(self.start, self.start + self.length) + self.draft

    @property
    def num_rows(self) -> int:
        """Rows this chunk puts into the forward (drafts included)."""
        return self.length + len(self.draft)

    def wire(self, lookback: int, block_ids: list[int]) -> "ScheduledChunk":
        """A self-contained copy for a tensor-parallel worker: the chunk's tokens, the `lookback`
        ids before it (Engram hashes) and the slot's `block_ids` (its block-table row), not the
        token history."""
        lo = max(0, self.start - lookback)
        ws = WireSequence(slot=self.seq.slot, base=lo, ids=self.seq.token_slice(lo, self.start + self.length),
                          num_tokens=self.seq.num_tokens, num_prompt=len(self.seq.prompt_token_ids),
                          request_id=self.seq.request_id, block_ids=list(block_ids),
                          prompt_rows=getattr(self.seq.params, "prompt_logprobs", None) is not None)
        return ScheduledChunk(ws, self.start, self.length, list(self.draft))


@dataclass
class WireSequence:
    """The part of a `Sequence` a worker's model runner reads: slot, ids ``[base, base + len(ids))``
    and the slot's blocks (rank 0's block manager decides them; the worker's table mirrors them)."""

    slot: int | None
    base: int
    ids: list[int]
    num_tokens: int
    num_prompt: int
    request_id: str
    block_ids: list[int]
    prompt_rows: bool = False  # the request asks for prompt logprobs: its prompt chunks compute every row

    @property
    def prompt_token_ids(self) -> range:
        return range(self.num_prompt)  # only its length is read

    def token_slice(self, start: int, end: int) -> list[int]:
        if start < self.base or end > self.base + len(self.ids):
            raise IndexError(f"tokens [{start}, {end}) are not on the wire (it holds [{self.base}, "
                             f"{self.base + len(self.ids)}))")
        return self.ids[start - self.base:end - self.base]


@dataclass
class StepPlan:
    """One step: the chunks to compute and the sequences preempted while scheduling them."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Scheduled tokens (drafts not counted)."""
        return sum(c.length for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
