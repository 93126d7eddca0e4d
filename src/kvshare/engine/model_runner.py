"""ModelRunner: scheduled chunks -> StepBatch -> model forward -> logits of the sampling rows.

Per step it builds the flat token ids, the ragged StepBatch (positions, seq_index, cu_seqlens,
chunk starts/lengths, and the same as host ints), the request slots and the block tables (one
gather from the block manager's per-slot table), the step's `StepAddresses` (bound to the backend
with ``begin_step``), calls ``model.forward(input_ids, batch, backend)``, then ``end_step``, and
returns the logits of the last token of every chunk that samples, in chunk order. A chunk of a
request that asks for prompt log-probabilities (run through ``run``) gets logits for all its rows,
handed to ``on_prompt_rows``.
"""

from __future__ import annotations

import itertools
from typing import Callable

import torch

from kvshare.cache.blocks import BlockManager
from kvshare.engine.scheduler import ScheduledChunk
from kvshare.runtime import CacheBackend, StepBatch


class ModelRunner:
    def __init__(self, model: torch.nn.Module, backend: CacheBackend, blocks: BlockManager,
                 device: torch.device | str) -> None:
        self.model = model
        self.backend = backend
        self.blocks = blocks
        self.device = torch.device(device)
        # Called with (input_ids, batch) before each forward (tensor parallelism sends them to the workers).
        self.before_forward: Callable[[torch.Tensor, StepBatch], None] | None = None
        # Called with (sequence, first position, logits rows [L, V]) for chunks that want every row.
        self.on_prompt_rows: Callable[..., None] | None = None

    @staticmethod
    def _all_rows(c: ScheduledChunk) -> bool:
        """Whether `c` covers prompt positions of a request that asks for prompt logprobs."""
        return getattr(c.seq.params, "prompt_logprobs", None) is not None and not c.draft \
            and c.start < len(c.seq.prompt_token_ids) - 1

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
    def forward(self, input_ids: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """One model forward over the cache, then the backend's end-of-step updates; the model's logits.

        The step's `StepAddresses` are built here, once, before the layers (``batch.addresses()``)
        and bound to the backend; the layers and the backend only look them up."""
        self.backend.begin_step(batch.addresses())
        try:
            return self.model(input_ids, batch, self.backend)
        finally:
            self.backend.end_step()  # deferred ring updates, inside inference mode like the rings themselves

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[int]]:
        """Run one step; returns (logits [S, vocab] fp32 of the sampling chunks, their chunk indices)."""
        wide = self.on_prompt_rows is not None and any(self._all_rows(c) for c in chunks)
        input_ids, batch, sampling = self.build_batch(chunks, all_rows=wide)
        if self.before_forward is not None:
            self.before_forward(input_ids, batch)
        logits = self.forward(input_ids, batch)
        if wide:  # hand each wide chunk its rows, keep each chunk's last row
            last, r = [], 0
            for c in chunks:
                n = c.length if self._all_rows(c) else 1
                if self._all_rows(c):
                    self.on_prompt_rows(c.seq, c.start, logits[r:r + n])  # type: ignore[misc]
                r += n
                last.append(r - 1)
            logits = logits.index_select(0, torch.tensor(last, dtype=torch.int64, device=logits.device))
        if len(sampling) != len(chunks):
            logits = logits.index_select(0, torch.tensor(sampling, dtype=torch.int64, device=logits.device))
        return logits.float(), sampling
