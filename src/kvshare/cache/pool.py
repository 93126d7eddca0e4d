"""BlockPool: the one block tensor, per-owner typed views, per-slot rings and states.

``blocks`` is ONE uint8 tensor ``[num_blocks, bytes_per_block]`` laid out by a CacheLayout. Every
region (owner, kind) gets a strided view ``[num_blocks, rows, row_bytes]`` built with
``as_strided`` at the absolute storage offset ``blocks.storage_offset() + region.offset`` (Python
ints, i.e. int64: no 32-bit overflow at large block ids). Rows hold the layout's real row format
(``RowFormat.pack`` / ``unpack``).

Sharing is identity: ``kv_view(l)`` returns the view object of ``topo.kv_cache_of(l)``, so
``pool.kv_view(l) is pool.kv_view(owner)``. With an unshared topology every compressed layer has
its own region; ``write_targets(kind, writer)`` then lists every copy that an owner's write must
reach (the owner's readers), so the math is unchanged while memory and write traffic reflect no
sharing.

Per request slot (outside the blocks): a sliding-window ring per layer (window row format, W rows)
and fp32 rings for the compressor / indexer-compressor states. A ring is keyed by (name, layer)
and created with the depth and width of its first use (window rings are created up front).

Invariants: block 0 is the null block (addressed only by padding and masked entries); regions are
disjoint (checked by the layout, tested by fill-and-check); -1 never indexes a tensor.
"""

from __future__ import annotations

import torch

from kvshare.cache.formats import RowFormat
from kvshare.cache.layout import CacheLayout
from kvshare.topology import Topology


class BlockPool:
    def __init__(self, layout: CacheLayout, num_blocks: int, num_slots: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        if num_blocks < 2:
            raise ValueError(f"the pool needs at least 2 blocks (block 0 is the null block), got {num_blocks}")
        self.layout = layout
        self.topo = layout.topo
        self.num_blocks = num_blocks
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = layout.block_size
        self.bytes_per_block = layout.bytes_per_block
        self.blocks = torch.zeros(num_blocks, max(1, self.bytes_per_block), dtype=torch.uint8, device=self.device)
        base = int(self.blocks.storage_offset())
        self._region_views: dict[tuple[str, int], torch.Tensor] = {}
        for r in layout.regions:
            self._region_views[(r.kind, r.owner)] = torch.as_strided(
                self.blocks, (num_blocks, r.rows, r.row_bytes), (self.blocks.stride(0), r.row_bytes, 1),
                base + int(r.offset))
        self.formats: dict[str, RowFormat] = {"kv": layout.kv_format, "index_k": layout.index_format}
        self._targets = self._write_targets()
        self.rings: dict[tuple[str, int], torch.Tensor] = {}
        self.ring_formats: dict[tuple[str, int], RowFormat | None] = {}
        w = layout.window_format
        for s in layout.states:
            if s.name == "window":
                self.rings[("window", s.layer)] = torch.zeros(
                    num_slots, s.rows, w.row_bytes, dtype=torch.uint8, device=self.device)
                self.ring_formats[("window", s.layer)] = w

    # ---- views ---------------------------------------------------------------------------------
    def view(self, kind: str, layer: int) -> torch.Tensor:
        """The [num_blocks, rows, row_bytes] view layer `layer` reads (its cache owner's object)."""
        key = (kind, layer)
        if key not in self._region_views:
            owner = self.topo.kv_cache_of(layer) if kind == "kv" else self.topo.index_k_cache_of(layer)
            key = (kind, owner)
        return self._region_views[key]

    def kv_view(self, layer: int) -> torch.Tensor:
        return self.view("kv", layer)

    def index_k_view(self, layer: int) -> torch.Tensor:
        return self.view("index_k", layer)

    def owner_views(self) -> dict[tuple[str, int], torch.Tensor]:
        """Every region's view keyed by (kind, owner)."""
        return dict(self._region_views)

    def _write_targets(self) -> dict[tuple[str, int], tuple[torch.Tensor, ...]]:
        """(kind, writer) -> the views a writer's rows go to (writer = an owner in the shared sense)."""
        if self.topo.share_cache:
            return {k: (v,) for k, v in self._region_views.items()}
        shared = Topology(self.topo.cfg, share_cache=True)
        out: dict[tuple[str, int], list[torch.Tensor]] = {}
        for (kind, t), v in self._region_views.items():
            p = shared[t]
            if kind == "kv":
                writer = shared.kv_cache_of(t)
            elif p.index_k_source is not None:
                writer = shared.index_k_cache_of(t)
            else:  # a layer that keeps index keys only in the unshared layout: its kv source's keys
                writer = shared.kv_cache_of(t)
            out.setdefault((kind, writer), []).append(v)
        return {k: tuple(v) for k, v in out.items()}

    def write_targets(self, kind: str, writer: int) -> tuple[torch.Tensor, ...]:
        """Views an owner's write of `kind` must reach (one when sharing, every reader's copy if not)."""
        key = (kind, writer)
        if key not in self._targets:
            if key in self._region_views:
                return (self._region_views[key],)
            raise KeyError(f"layer {writer} owns no {kind!r} cache; only owners write")
        return self._targets[key]

    def ratio(self, layer: int) -> int:
        return self.topo[layer].ratio

    # ---- per-slot rings --------------------------------------------------------------------------
    def ring(self, name: str, layer: int, depth: int, width: int) -> tuple[torch.Tensor, RowFormat | None]:
        """The ring (name, layer): window rings are packed rows, state rings fp32 [slots, depth, width]."""
        key = (name, layer)
        r = self.rings.get(key)
        fmt = self.ring_formats.get(key)
        if r is None:
            r = torch.zeros(self.num_slots, depth, width, dtype=torch.float32, device=self.device)
            self.rings[key], self.ring_formats[key], fmt = r, None, None
        cols = fmt.dim if fmt is not None else r.shape[2]
        if r.shape[1] != depth or cols != width:
            raise ValueError(f"ring {name!r} of layer {layer} holds [{r.shape[1]}, {cols}] rows, "
                             f"asked for [{depth}, {width}]")
        return r, fmt

    def reset_slots(self, slots: torch.Tensor) -> None:
        """Zero every ring of the given slots (a recycled slot starts empty)."""
        for r in self.rings.values():
            r.index_fill_(0, slots.to(r.device), 0)

    # ---- accounting ------------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        return self.blocks.numel()

    @property
    def ring_bytes(self) -> int:
        return sum(r.numel() * r.element_size() for r in self.rings.values())
