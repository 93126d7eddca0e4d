"""CacheBackend: what the model asks of its cache in a step (the protocol both caches implement).

The model owns all math (projections, compressors, indexer, top-k, attention). A CacheBackend only
stores and gathers rows; two implement it: the dense reference cache (`cache/dense.py`, one or more
sequences, plain tensors) and the paged block pool (`cache/paged_backend.py`). The step package
imports no cache code: the ring and in-place key types the protocol hands out (`cache.rings.Ring`,
`cache.in_place.WindowKeys` / `PoolKeys`) are named here as `Any`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from kvshare.step.addresses import StepAddresses
from kvshare.step.batch import StepBatch

Ring = Any  # cache.rings.Ring
WindowKeys = Any  # cache.in_place.WindowKeys
PoolKeys = Any  # cache.in_place.PoolKeys


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
    reads (the dense cache), or whose rows are neither plain values of the reader's dtype nor (for
    a reader that decodes them, ``reader_decodes``) of a native FP8 / FP4 scheme, returns None, and
    the reader gathers (``history`` / ``gather_*``). Where
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
        self, name: str, layer: int, values: torch.Tensor, depth: int, batch: StepBatch, decode: bool = False,
        reader_decodes: bool = False,
    ) -> WindowKeys | None:
        """`history` of every token row, in place (see the class doc), or None where not offered;
        `decode`: quantised rows may be decoded once into a copy read in place; `reader_decodes`:
        the reader decodes quantised rows of a native scheme itself (they come with their codec)."""
        ...

    def pool_keys(self, kind: str, layer: int, dtype: torch.dtype, batch: StepBatch,
                  decode: bool = False, reader_decodes: bool = False) -> PoolKeys | None:
        """The compressed rows layer `layer` reads, in place, where they are plain `dtype` values (or, with
        `decode`, quantised rows decoded once into a copy; with `reader_decodes`, quantised rows of a
        native scheme with their codec); else None."""
        ...
