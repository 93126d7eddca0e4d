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
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from kvshare.step_addresses import StepAddresses

if TYPE_CHECKING:
    from kvshare.cache.in_place import PoolKeys, WindowKeys
    from kvshare.cache.rings import Ring


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
    # (starts, lens, slots) as host ints when known (``build``): addresses need no device read
    host: tuple[list[int], list[int], list[int]] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    @property
    def num_seqs(self) -> int:
        return int(self.lens.numel())

    @property
    def ends(self) -> torch.Tensor:
        return self.starts + self.lens

    def host_lists(self) -> tuple[list[int], list[int], list[int]]:
        """(starts, lens, slots) as Python ints: ``host`` when the batch was built from host lists,
        else read from the tensors once (one device read per step, outside the layers)."""
        if self.host is None:
            self.host = (self.starts.tolist(), self.lens.tolist(), self.slots.tolist())
        return self.host

    def __getstate__(self) -> dict:
        """Pickled without its addresses (tensor parallelism sends batches; a receiver builds its own)."""
        return {k: v for k, v in self.__dict__.items() if k != "_addresses"}

    def addresses(self) -> "StepAddresses":
        """This step's `StepAddresses`, built on first use and kept with the batch (a batch moved
        to another device by ``dataclasses.replace`` builds its own)."""
        addr = self.__dict__.get("_addresses")
        if addr is None or addr.batch is not self:
            addr = StepAddresses(self)
            self.__dict__["_addresses"] = addr
        return addr

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
        lens_h = np.asarray(lens, dtype=np.int64)
        cu_h = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lens_h, out=cu_h[1:])
        seq_h = np.repeat(np.arange(n, dtype=np.int64), lens_h)
        pos_h = np.arange(int(cu_h[-1]), dtype=np.int64) - cu_h[:-1][seq_h] + np.asarray(starts, dtype=np.int64)[seq_h]
        flat = torch.from_numpy(np.concatenate([pos_h, seq_h, cu_h, np.asarray(starts, dtype=np.int64), lens_h]))
        positions, seq_index, cu, starts_t, lens_t = flat.to(device).split([len(pos_h), len(pos_h), n + 1, n, n])
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
        host = (list(starts), list(lens), list(slots) if slots is not None else list(range(n)))
        return cls(positions, seq_index, cu, starts_t, lens_t, slots_t, block_tables, lr, prev, host)


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

    Step boundaries: ``begin_step(addresses, capture=None)`` binds the step's `StepAddresses`
    (``batch.addresses()``, built once per step; a backend called with a batch whose addresses it
    has not bound binds them itself) and, for prefix caching, a ``cache.checkpoint.BoundaryCapture``
    (also settable as the ``capture`` attribute); ``end_step()`` applies what the step deferred
    (ring updates) and drops the step's reads. Every address a read or write needs comes from the
    bound addresses, so no method reads a device value on the host when the model asks with the
    addresses' own tensors.

    History rings (``history``) serve the sliding window and the compressor states: for each
    requested token row they return the stored rows of positions ``t - depth + 1 .. t`` of that
    token's sequence (from previous steps and from this step's own rows), with a validity mask
    (False for positions < 0). After the step the backend keeps, per sequence, the last `depth`
    positions, so the next step sees them. `name` separates rings of one layer ("window",
    "compressor", "indexer_compressor"). The ring arithmetic is `cache.rings.Ring`'s.

    Compressed rows (``write_rows`` / ``gather_rows`` / ``gather_prefix``) serve the compressed KV
    ("kv") and index keys ("index_k") of an owner layer, addressed by (sequence, compressed
    index j). `layer` is always the model layer asking: ``write_rows(kind, L)`` stores the rows L
    computed in every region the backend's `RegionMap` (cache/regions.py) assigns to L, and raises
    `CacheWriteError` if L writes none; ``gather_*(kind, L)`` read the one region L reads (its
    source's when sharing, its own copy when not). The model never names regions or cache modes.
    Gathers never index with -1: masked entries come back as zeros.

    ``draft_window(layer, width, dtype)`` is the `Ring` of a DSpark draft stage's context window
    (`model/dspark_window.py` reads and writes it; nothing else reaches into the storage).

    In-place reads (a declared capability, part of the protocol: every backend implements both
    methods): ``window_keys`` and ``pool_keys`` hand a native kernel the stored window ring / pool
    rows themselves (`cache.in_place`) instead of gathered copies. A backend that offers no such
    reads (the dense cache), or whose rows are not plain values of the reader's dtype (FP8 / FP4
    formats), returns None, and the reader gathers (``history`` / ``gather_*``). Where
    ``window_keys`` returns rows it defers the ring update exactly as ``history`` would.
    """

    capture: object | None  # the step's BoundaryCapture (paged backend; None: no checkpoint taken)

    def begin_step(self, addresses: StepAddresses, capture: object | None = None) -> None:
        ...

    def end_step(self) -> None:
        ...

    def draft_window(self, layer: int, width: int, dtype: torch.dtype) -> Ring:
        ...

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

    def remember(self, name: str, layer: int, values: torch.Tensor, depth: int, batch: StepBatch) -> None:
        """`history`'s ring update without its read: a step none of whose rows needs a history
        (a compressor's step that completes no group) still keeps `values` for later steps; the
        ring ends the step holding what `history` would have left."""
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

    def window_keys(
        self, name: str, layer: int, values: torch.Tensor, depth: int, batch: StepBatch
    ) -> WindowKeys | None:
        """`history` of every token row, in place (see the class doc), or None where not offered."""
        ...

    def pool_keys(self, kind: str, layer: int, dtype: torch.dtype, batch: StepBatch) -> PoolKeys | None:
        """The compressed rows layer `layer` reads, in place, where they are plain `dtype` values; else None."""
        ...
