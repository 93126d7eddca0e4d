"""StepReadCache: gathered and unpacked cache rows reused within one step (sharing saves compute).

When layers share a region (a kv source's compressed rows read by its Reuse layers, an index-K
owner's keys scored by several index sources), they ask the backend for the same rows of the same
view in the same step. The first read gathers and unpacks them; later reads with the same request
get the same tensor back. Entries are keyed by the view object (so with sharing off every layer
reads its own copy and nothing is shared), the kind of read, and the request tensors themselves,
by identity: the model asks every reader of a region with the same tensor objects (one top-k of
the index source, one `n_rows` of the step's addresses, one block table), so no contents are
compared and the lookup never reads a device value on the host.

Invariants: a write to a view drops that view's entries (`invalidate`); the backend clears the
cache at every step boundary; entries above `max_bytes` in total are not kept (prefill gathers of
[T, k, d] rows can be large), so caching never holds more than that much memory. A hit returns
bit-identical values to a fresh gather (the same bytes unpacked the same way).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_MAX_BYTES = 256 << 20


@dataclass
class _Entry:
    view: torch.Tensor
    kind: str
    key: torch.Tensor
    aux: torch.Tensor
    value: torch.Tensor


class StepReadCache:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: list[_Entry] = []
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, view: torch.Tensor, kind: str, key: torch.Tensor, aux: torch.Tensor) -> torch.Tensor | None:
        """The cached rows for this request, or None."""
        for e in self._entries:
            if e.view is view and e.kind == kind and e.key is key and e.aux is aux:
                self.hits += 1
                return e.value
        self.misses += 1
        return None

    def put(self, view: torch.Tensor, kind: str, key: torch.Tensor, aux: torch.Tensor, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        if self._bytes + size > self.max_bytes:
            return
        self._entries.append(_Entry(view, kind, key, aux, value))
        self._bytes += size

    def invalidate(self, view: torch.Tensor) -> None:
        """Drop every entry read from `view` (it was just written)."""
        kept = [e for e in self._entries if e.view is not view]
        self._bytes = sum(e.value.numel() * e.value.element_size() for e in kept)
        self._entries = kept

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0
