"""ModelRunner: scheduled chunks -> StepBatch -> model forward -> logits of the sampling rows.

Per step it builds the flat token ids, the ragged StepBatch (positions, seq_index, cu_seqlens,
chunk starts/lengths, and the same as host ints), the request slots and the block tables (one
gather from the block manager's per-slot table), the step's `StepAddresses` (bound to the backend
with ``begin_step``), calls ``model.forward(input_ids, batch, backend, state)`` and returns the
logits rows of every chunk that samples, in chunk order: its last row, and with drafts one row per
draft before it (``1 + len(draft)`` rows). The `Executor` (engine/executor.py) is its only caller
and ends the backend's step after it. A chunk of a request that asks for prompt log-probabilities
gets logits for all its rows, handed to ``on_prompt_rows`` (rank 0's; a tensor-parallel worker
computes the same rows, told by the chunk's wire form, and drops them).
"""

from __future__ import annotations

import itertools
from typing import Callable

import torch

from kvshare.cache.blocks import BlockManager
from kvshare.engine.step_plan import ScheduledChunk, WireSequence
from kvshare.step import CacheBackend, StepBatch, StepState


class ModelRunner:
    def __init__(self, model: torch.nn.Module, backend: CacheBackend, blocks: BlockManager,
                 device: torch.device | str) -> None:
        self.model = model
        self.backend = backend
        self.blocks = blocks
        self.device = torch.device(device)
        # Called with (sequence, first position, logits rows [L, V]) for chunks that want every row.
        self.on_prompt_rows: Callable[..., None] | None = None

    @staticmethod
    def _all_rows(c: ScheduledChunk) -> bool:
        """Whether `c` covers prompt positions of a request that asks for prompt logprobs."""
        seq = c.seq
        wants = (seq.prompt_rows if isinstance(seq, WireSequence)
                 else getattr(seq.params, "prompt_logprobs", None) is not None)
        return wants and not c.draft and c.start < len(seq.prompt_token_ids) - 1

    def build_batch(self, chunks: list[ScheduledChunk],
                    all_rows: bool = False) -> tuple[torch.Tensor, StepBatch, list[int]]:
        """(input_ids [T], batch, indices of the chunks that sample); with `all_rows`, chunks that
        want prompt logprobs get logits for every row (``run`` splits them off)."""
        starts = [c.start for c in chunks]
        lens = [c.length + len(c.draft) for c in chunks]
        slots = [c.seq.slot for c in chunks]
        ids = list(itertools.chain.from_iterable(c.token_ids for c in chunks))
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        sampling = [i for i, c in enumerate(chunks) if c.samples]
        slot_t = torch.tensor(slots, dtype=torch.int64, device=self.blocks.tables.device)
        ncols = max(1, self.blocks.blocks_needed(max(s + n for s, n in zip(starts, lens))))
        tables = self.blocks.tables[:, :ncols].index_select(0, slot_t).to(self.device)
        # Logits only for the last row of each sequence (cheap), sampling rows picked after; a chunk
        # with drafts also for the rows that verify them.
        ends = list(itertools.accumulate(lens))
        back = getattr(self.model, "engram_lookback", 0)  # Engram hashes need the ids before each chunk
        prev = [c.seq.token_slice(max(0, c.start - back), c.start) for c in chunks] if back else None
        rows = [r for e, n, c in zip(ends, lens, chunks)
                for r in range(e - (n if all_rows and self._all_rows(c) else 1 + len(c.draft)), e)]
        batch = StepBatch.build(starts, lens, slots, block_tables=tables, logit_rows=rows, device=self.device,
                                prev_tokens=prev)
        return input_ids, batch, sampling

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: StepBatch, state: StepState | None = None) -> torch.Tensor:
        """The model's logits over `batch` (no end of step: the executor's). The step's
        `StepAddresses` are built here, once, before the layers (``batch.addresses()``), and bound
        to the backend; the layers and the backend only look them up."""
        self.backend.begin_step(batch.addresses())
        if state is None:  # without `state`: models wrapped by tests take (input_ids, batch, backend)
            return self.model(input_ids, batch, self.backend)
        return self.model(input_ids, batch, self.backend, state)

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], state: StepState | None = None) -> tuple[torch.Tensor, list[int]]:
        """Run one forward (no end of step: the executor's); returns (logits [R, vocab] of the
        sampling chunks' rows, as the model returns them: fp32, float64 in a float64 model; their
        chunk indices). Chunks that want prompt logprobs hand all their rows to ``on_prompt_rows`` first."""
        wide = any(self._all_rows(c) for c in chunks)
        input_ids, batch, sampling = self.build_batch(chunks, all_rows=wide)
        logits = self.forward(input_ids, batch) if state is None else self.forward(input_ids, batch, state)
        if wide:  # hand each wide chunk its rows; every chunk keeps its usual rows
            own: list[list[int]] = []
            r = 0
            for c in chunks:
                per_c, every = 1 + len(c.draft), self._all_rows(c)
                n = c.length if every else per_c
                if every and self.on_prompt_rows is not None:
                    self.on_prompt_rows(c.seq, c.start, logits[r:r + n])
                r += n
                own.append(list(range(r - per_c, r)))
            rows = [k for i in sampling for k in own[i]]
            return logits.index_select(0, torch.tensor(rows, dtype=torch.int64, device=logits.device)), sampling
        if len(sampling) != len(chunks):
            per = [1 + len(c.draft) for c in chunks]
            first = list(itertools.accumulate(per, initial=0))
            keep = [first[i] + j for i in sampling for j in range(per[i])]
            logits = logits.index_select(0, torch.tensor(keep, dtype=torch.int64, device=logits.device))
        return logits, sampling
