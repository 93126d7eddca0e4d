"""Per-step contracts between the model and its cache: StepBatch, StepState, CacheBackend.

A forward step processes a flat, ragged batch of T tokens from N sequences; sequence i
contributes the consecutive positions ``[starts[i], starts[i] + lens[i])`` (a prefill chunk, a
whole prompt, or one decode token). Tokens of one sequence are contiguous and in position order.

The model owns all math (projections, compressors, indexer, top-k, attention). A CacheBackend only
stores and gathers rows; two implement it: the dense reference cache (`model/dense_cache.py`, one
or more sequences, plain tensors) and the paged block pool (`cache/paged_backend.py`).

StepState carries the cross-layer hand-offs of one step (top-k rows, candidate masks) in layer
order. It is created per step, never global, and readers assert that what they need is there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class StepBatch:
    """A ragged batch of sequence chunks.

    Invariants: ``positions[cu_seqlens[i]:cu_seqlens[i+1]] == arange(starts[i], starts[i]+lens[i])``;
    ``seq_index[t]`` is the sequence (0..N-1) of token t; ``slots[i]`` is the request slot whose
    rings and states hold sequence i's history (prior positions ``< starts[i]``).
    ``block_tables`` (paged backend only) maps sequence i's logical block b to a physical block.
    ``logit_rows`` are the token rows whose logits the caller needs (None: every row).
    ``prev_tokens`` [N, K] holds each sequence's token ids at positions ``starts[i] - K ..
    starts[i] - 1`` (oldest first; columns before position 0 are padding); Engram hashes a chunk's
    first tokens with them. Only needed when a chunk starts after position 0 and the model has Engram.
    """

    positions: torch.Tensor  # [T] int64
    seq_index: torch.Tensor  # [T] int64
    cu_seqlens: torch.Tensor  # [N+1] int64
    starts: torch.Tensor  # [N] int64
    lens: torch.Tensor  # [N] int64
    slots: torch.Tensor  # [N] int64
    block_tables: torch.Tensor | None = None  # [N, max_blocks] int64, 0 = null block
    logit_rows: torch.Tensor | None = None  # [R] int64
    prev_tokens: torch.Tensor | None = None  # [N, K] int64

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    @property
    def num_seqs(self) -> int:
        return int(self.lens.numel())

    @property
    def ends(self) -> torch.Tensor:
        return self.starts + self.lens

    @classmethod
    def build(
        cls,
        starts: list[int],
        lens: list[int],
        slots: list[int] | None = None,
        *,
        block_tables: torch.Tensor | None = None,
        logit_rows: list[int] | torch.Tensor | None = None,
        device: torch.device | str = "cpu",
        prev_tokens: list[list[int]] | torch.Tensor | None = None,
    ) -> "StepBatch":
        """Build the index tensors from per-sequence chunk starts and lengths.

        `prev_tokens` as lists: sequence i's ids just before its chunk, at most K of them (fewer
        only when the chunk starts before position K); they are left-padded to [N, K]."""
        if len(starts) != len(lens) or not lens or min(lens) <= 0:
            raise ValueError("every sequence in a step needs a chunk of at least one token")
        n = len(lens)
        lens_t = torch.tensor(lens, dtype=torch.int64, device=device)
        starts_t = torch.tensor(starts, dtype=torch.int64, device=device)
        cu = torch.zeros(n + 1, dtype=torch.int64, device=device)
        cu[1:] = torch.cumsum(lens_t, 0)
        seq_index = torch.repeat_interleave(torch.arange(n, device=device), lens_t)
        positions = torch.arange(int(cu[-1]), device=device) - cu[:-1][seq_index] + starts_t[seq_index]
        slots_t = torch.tensor(slots if slots is not None else list(range(n)), dtype=torch.int64, device=device)
        lr = None
        if logit_rows is not None:
            lr = torch.as_tensor(logit_rows, dtype=torch.int64, device=device)
        prev = None
        if isinstance(prev_tokens, torch.Tensor):
            prev = prev_tokens.to(device=device, dtype=torch.int64)
        elif prev_tokens is not None:
            k = max((len(p) for p in prev_tokens), default=0)
            for i, p in enumerate(prev_tokens):
                if len(p) != min(k, starts[i]):
                    raise ValueError(f"sequence {i}: {len(p)} previous tokens for a chunk at position {starts[i]} "
                                     f"(expected {min(k, starts[i])})")
            prev = torch.tensor([[0] * (k - len(p)) + list(p) for p in prev_tokens], dtype=torch.int64,
                                device=device).reshape(n, k)
        return cls(positions, seq_index, cu, starts_t, lens_t, slots_t, block_tables, lr, prev)


@dataclass
class StepState:
    """Hand-offs published during one forward step, in layer order.

    ``topk[src]``: [T, k] int64 compressed-entry indices picked by index source `src` for every
    token row (-1 = none; never used as a tensor index). ``candidates``: [T, Wc] bool mask over
    compressed positions published by the candidate source for later index sources.
    """

    topk: dict[int, torch.Tensor] = field(default_factory=dict)
    candidates: torch.Tensor | None = None
    candidate_source: int | None = None
    # DSpark taps: keys are the layers whose input stream to record (set by the caller before the
    # forward); the model fills each with the [T, D] mean over the mHC copies entering that layer.
    taps: dict[int, torch.Tensor | None] | None = None

    def publish_topk(self, layer: int, idx: torch.Tensor) -> None:
        self.topk[layer] = idx

    def topk_of(self, source: int, reader: int) -> torch.Tensor:
        if source not in self.topk:
            raise RuntimeError(f"layer {reader}: index source {source} published no top-k this step")
        return self.topk[source]

    def publish_candidates(self, layer: int, mask: torch.Tensor) -> None:
        self.candidates = mask
        self.candidate_source = layer

    def candidates_of(self, source: int, reader: int) -> torch.Tensor:
        if self.candidates is None or self.candidate_source != source:
            raise RuntimeError(f"layer {reader}: candidate source {source} published no candidates this step")
        return self.candidates


class CacheBackend(Protocol):
    """Storage the model reads and writes during a step. All tensors are on the model's device.

    History rings (``history``) serve the sliding window and the compressor states: for each
    requested token row they return the stored rows of positions ``t - depth + 1 .. t`` of that
    token's sequence (from previous steps and from this step's own rows), with a validity mask
    (False for positions < 0). After the call the backend keeps, per sequence, the last `depth`
    positions, so the next step sees them. `name` separates rings of one layer ("window",
    "compressor", "indexer_compressor").

    Compressed rows (``write_rows`` / ``gather_rows`` / ``gather_prefix``) serve the compressed KV
    ("kv") and index keys ("index_k") of an owner layer, addressed by (sequence, compressed
    index j). `layer` is always the model layer asking: ``write_rows(kind, L)`` stores the rows L
    computed in every region the backend's `RegionMap` (cache/regions.py) assigns to L, and raises
    `CacheWriteError` if L writes none; ``gather_*(kind, L)`` read the one region L reads (its
    source's when sharing, its own copy when not). The model never names regions or cache modes.
    Gathers never index with -1: masked entries come back as zeros.
    """

    def history(
        self,
        name: str,
        layer: int,
        values: torch.Tensor,  # [T, w] this step's rows, one per token
        depth: int,
        batch: StepBatch,
        rows: torch.Tensor | None = None,  # [R] token rows to return (None: all T)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([R, depth, w] oldest first, [R, depth] bool)
        ...

    def write_rows(
        self, kind: str, layer: int, seq: torch.Tensor, index: torch.Tensor, values: torch.Tensor, batch: StepBatch
    ) -> None:
        """Store values[e] as compressed row index[e] of sequence seq[e] (kind: "kv" or "index_k")."""
        ...

    def gather_rows(
        self, kind: str, layer: int, seq: torch.Tensor, index: torch.Tensor, batch: StepBatch
    ) -> torch.Tensor:
        """Rows [*index.shape, w] of sequences seq (broadcast to index's leading dims); -1 gives zeros."""
        ...

    def gather_prefix(
        self, kind: str, layer: int, n_rows: torch.Tensor, batch: StepBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [0, n_rows[i]) of each sequence i as [N, max(n_rows), w] plus a [N, max] validity mask."""
        ...
