"""RegionMap: the one place that decides which cache region each layer reads and writes.

A region is named ``(kind, owner)``: kind "kv" (compressed KV rows) or "index_k" (index keys),
owner the layer whose slot of the block holds it. The model never names regions: it writes the
rows a layer computed with ``write_rows(kind, layer)`` and reads with ``gather_*(kind, layer)``;
every `CacheBackend` resolves ``layer`` through this map, so shared and unshared caches run the
same model code.

Shared (``share_cache=True``, spec/cache.md §9.3): regions belong to the sources only.

* ``reads_kv[L]`` = L's kv source; ``reads_index[L]`` = L's index-K owner (index sources only);
* ``writes_kv[S]`` = (S,) for a kv source S; ``writes_index[S]`` = (S,) for an index-K owner.

Unshared (what an engine without sharing stores, reads and writes):

* every compressed layer owns a kv region, and so does every layer that attends a top-k
  selection own an index-K region (spec/cache.md §4.3 "all 38 compressed layers owned their own":
  10,324 B/token for V4.1-Flash fp4);
* ``reads_kv[L]`` = L and ``reads_index[L]`` = L: each layer reads its own copy;
* the layer that computes rows writes them to every copy that holds them: ``writes_kv[S]`` =
  the layers whose kv source is S; ``writes_index[S]`` = the layers whose index source scores
  S's keys. A Reuse layer's index-K copy is written but has no reader, because the model's maths
  gives a Reuse layer no index query (it takes its index source's top-k).

Invariants (tested): every region in ``kv_owners`` / ``index_owners`` is written by exactly one
layer and every ``reads_*`` names an owned region; a layer whose ``writes_*`` is empty raises
`CacheWriteError` when it writes (a consumer has no write path). Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvshare.errors import KVShareError

if TYPE_CHECKING:
    from kvshare.topology import Topology

KINDS = ("kv", "index_k")


class CacheWriteError(KVShareError, RuntimeError):
    """A layer tried to write a cache region it does not write (spec/cache.md §9.3)."""


@dataclass(frozen=True)
class LayerRegions:
    """The regions one layer touches, as owner layer ids (None / () = none)."""

    layer: int
    reads_kv: int | None
    reads_index: int | None
    writes_kv: tuple[int, ...]
    writes_index: tuple[int, ...]


class RegionMap:
    """Per-layer region resolution for one Topology and one cache mode (see module doc)."""

    def __init__(self, topo: "Topology", share_cache: bool = True) -> None:
        self.topo = topo
        self.share_cache = share_cache
        plans = topo.layers
        if share_cache:
            kv_writer = {p.layer: p.layer for p in plans if p.is_kv_source}
            ik_writer = {p.layer: p.layer for p in plans if p.is_index_k_source}
        else:
            kv_writer = {p.layer: p.kv_source for p in plans if p.kv_source is not None}
            # A layer's index copy holds the keys its index source scores (its own, for an index source).
            ik_writer = {p.layer: topo[p.index_source].index_k_source for p in plans
                         if p.is_compressed and p.index_source is not None}
        self.kv_owners: tuple[int, ...] = tuple(sorted(kv_writer))
        self.index_owners: tuple[int, ...] = tuple(sorted(ik_writer))
        self.layers: tuple[LayerRegions, ...] = tuple(
            LayerRegions(
                layer=p.layer,
                reads_kv=None if p.kv_source is None else (p.kv_source if share_cache else p.layer),
                reads_index=None if p.index_k_source is None else (p.index_k_source if share_cache else p.layer),
                writes_kv=tuple(o for o in self.kv_owners if kv_writer[o] == p.layer),
                writes_index=tuple(o for o in self.index_owners if ik_writer[o] == p.layer),
            )
            for p in plans)
        for lr in self.layers:
            assert lr.reads_kv is None or lr.reads_kv in kv_writer, lr
            assert lr.reads_index is None or lr.reads_index in ik_writer, lr

    def __getitem__(self, layer: int) -> LayerRegions:
        return self.layers[layer]

    def owners(self, kind: str) -> tuple[int, ...]:
        """Layers that own a region of `kind`, in layer order."""
        return self.kv_owners if _check_kind(kind) == "kv" else self.index_owners

    def reads(self, kind: str, layer: int) -> int:
        """The owner of the `kind` region layer `layer` reads (KeyError if it reads none)."""
        lr = self.layers[layer]
        owner = lr.reads_kv if _check_kind(kind) == "kv" else lr.reads_index
        if owner is None:
            why = "it has compress ratio 0" if kind == "kv" or self.topo[layer].ratio == 0 else "it scores no index keys"
            raise KeyError(f"layer {layer} reads no {kind!r} region ({why})")
        return owner

    def writes(self, kind: str, layer: int) -> tuple[int, ...]:
        """Owners of the regions the `kind` rows computed by `layer` go to; raises if there are none."""
        lr = self.layers[layer]
        owners = lr.writes_kv if _check_kind(kind) == "kv" else lr.writes_index
        if not owners:
            p = self.topo[layer]
            src = p.kv_source if kind == "kv" else p.index_k_source
            hint = f"; its rows are written by layer {src}" if src is not None and src != layer else ""
            raise CacheWriteError(f"layer {layer} ({p.role.value}) writes no {kind!r} cache region: only the "
                                  f"layer that computes the rows writes them{hint}")
        return owners

    def readers(self, kind: str, owner: int) -> tuple[int, ...]:
        """Layers that read region (kind, owner)."""
        key = "reads_kv" if _check_kind(kind) == "kv" else "reads_index"
        return tuple(lr.layer for lr in self.layers if getattr(lr, key) == owner)


def _check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown cache region kind {kind!r}; use one of {KINDS}")
    return kind
