"""BlockPool: the one block tensor, per-owner typed views, per-slot rings and states.

``blocks`` is ONE uint8 tensor ``[num_blocks, bytes_per_block]`` laid out by a CacheLayout. Every
region (owner, kind) gets a strided view ``[num_blocks, rows, row_bytes]`` built with
``as_strided`` at the absolute storage offset ``blocks.storage_offset() + region.offset`` (Python
ints, i.e. int64: no 32-bit overflow at large block ids). Rows hold the layout's real row format
(``RowFormat.pack`` / ``unpack``).

Regions are resolved once, at construction, from the layout's RegionMap: ``read_view(kind, L)``
is the view layer L reads (when sharing, the owner's view object itself, so ``pool.kv_view(l) is
pool.kv_view(owner)``; unshared, L's own copy) and ``write_views(kind, L)`` the views the rows
computed by L go to (raises CacheWriteError for a layer that writes none). Both are dict lookups.

Per request slot (outside the blocks), allocated at construction from ``layout.states``, each a
`cache.rings.Ring` (``ring(name, layer)``): a sliding-window ring per layer (window row format,
W + slack rows) and an fp32 ring per compressor / indexer-compressor state ([slots, rows, tensors *
width]: the kv and score halves side by side). ``rings`` maps the same keys to the bare tensors.
``ring_bytes`` therefore equals ``num_slots * layout.state_bytes_per_seq`` from the start.

Invariants: block 0 is the null block (addressed only by padding and masked entries); regions are
disjoint (checked by the layout, tested by fill-and-check); -1 never indexes a tensor.
"""

from __future__ import annotations

import torch

from kvshare.cache.formats import RowFormat
from kvshare.cache.layout import CacheLayout
from kvshare.cache.rings import Ring


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
        rmap = layout.regions_map
        self._reads: dict[tuple[str, int], torch.Tensor] = {}
        self._writes: dict[tuple[str, int], tuple[torch.Tensor, ...]] = {}
        for lr in rmap.layers:
            for kind, read, writes in (("kv", lr.reads_kv, lr.writes_kv), ("index_k", lr.reads_index, lr.writes_index)):
                if read is not None:
                    self._reads[(kind, lr.layer)] = self._region_views[(kind, read)]
                if writes:
                    self._writes[(kind, lr.layer)] = tuple(self._region_views[(kind, o)] for o in writes)
        self.rings: dict[tuple[str, int], torch.Tensor] = {}  # the ring tensors (digests, accounting)
        self._rings: dict[tuple[str, int], Ring] = {}
        state_dtype = {4: torch.float32, 8: torch.float64}[layout.state_dtype_bytes]
        w = layout.window_format
        for s in layout.states:
            key = (s.name, s.layer)
            fmt: RowFormat | None
            if s.name == "window":
                data = torch.zeros(num_slots, s.rows, w.row_bytes, dtype=torch.uint8, device=self.device)
                fmt, width = w, w.dim
            else:
                data = torch.zeros(num_slots, s.rows, s.tensors * s.width, dtype=state_dtype, device=self.device)
                fmt, width = None, s.tensors * s.width
            self.rings[key] = data
            self._rings[key] = Ring(data, fmt, s.depth, width)

    # ---- views ---------------------------------------------------------------------------------
    def read_view(self, kind: str, layer: int) -> torch.Tensor:
        """The [num_blocks, rows, row_bytes] view layer `layer` reads."""
        try:
            return self._reads[(kind, layer)]
        except KeyError:
            self.layout.regions_map.reads(kind, layer)  # raises the descriptive KeyError
            raise

    def write_views(self, kind: str, layer: int) -> tuple[torch.Tensor, ...]:
        """The views the `kind` rows computed by `layer` go to (one when sharing, every copy if not)."""
        try:
            return self._writes[(kind, layer)]
        except KeyError:
            self.layout.regions_map.writes(kind, layer)  # raises CacheWriteError
            raise

    def kv_view(self, layer: int) -> torch.Tensor:
        return self.read_view("kv", layer)

    def index_k_view(self, layer: int) -> torch.Tensor:
        return self.read_view("index_k", layer)

    def owner_views(self) -> dict[tuple[str, int], torch.Tensor]:
        """Every region's view keyed by (kind, owner)."""
        return dict(self._region_views)

    def ratio(self, layer: int) -> int:
        return self.topo[layer].ratio

    # ---- per-slot rings --------------------------------------------------------------------------
    def ring(self, name: str, layer: int, depth: int | None = None, width: int | None = None) -> Ring:
        """The ring (name, layer) planned by the layout: window rings hold packed rows, state rings fp32
        (or the layout's state dtype). Checks that it spans `depth` positions of `width` values."""
        r = self._rings.get((name, layer))
        if r is None:
            raise KeyError(f"layer {layer} has no {name!r} ring in this cache layout (the layout plans "
                           f"{sorted(k for k in self.rings if k[1] == layer)})")
        if (depth is not None and r.rows < depth) or (width is not None and r.width != width):
            raise ValueError(f"ring {name!r} of layer {layer} holds [{r.rows}, {r.width}] rows, "
                             f"asked for [{depth}, {width}]")
        return r

    def reset_slots(self, slots: torch.Tensor) -> None:
        """Zero every ring of the given slots (a recycled slot starts empty)."""
        for r in self._rings.values():
            r.reset(slots)

    # ---- accounting ------------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        return self.blocks.numel()

    @property
    def ring_bytes(self) -> int:
        return sum(r.numel() * r.element_size() for r in self.rings.values())
