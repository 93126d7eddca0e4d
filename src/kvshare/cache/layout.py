"""CacheLayout: where every owner's rows live inside one cache block, and what a sequence costs.

One block covers `block_size` consecutive token positions of one sequence. For each cache owner,
in layer order, the block holds an index-K region and then a compressed-KV region, each of
``block_size // ratio`` rows (the owner's ratio) and each padded up to `alignment` bytes. V4
ratio-128 layers have no index-K region. Which layers own regions, and which region each layer
reads or writes, is the layout's `RegionMap` (``layout.regions_map``, cache/regions.py), shared
or unshared; `reads_region` / `write_regions` turn its answers into Regions. Example, V4.1-Flash fp4 (288-B KV, 68-B index K) at block 128: L2 [0, 4352)
[4352, 22784), L8, L14 likewise, L20 [68352, 77056) [77056, 113920): 113,920 B = 890 B/token.

Per-sequence state lives outside the blocks: a sliding-window ring of W (+ slack) rows for every
layer, draft layers included; for every owner with ratio > 1 an fp32 (kv, score) compressor ring
of ``coff * ratio`` (+ slack) rows of width ``coff * head_dim`` (coff = 2 for V4 ratio 4, else 1); for V4
ratio-4 layers also an indexer-compressor ring of width ``coff * index_head_dim``.

Invariants (checked on construction, tested): regions are disjoint, aligned, inside the block
and in layer order; ``bytes_per_block`` equals the end of the last region; only owners have
regions; ``block_size % ratio == 0`` for every ratio in use. All sizes are Python ints (no
overflow). Slack rows (speculative decoding: one per draft token, backbone rings only) let a
verify step write rejected positions without overwriting rows a later step still reads.
Consumers of these numbers must compute byte offsets in int64: ``block_id * bytes_per_block``
passes 2^32 at ~37.7k blocks of 113,920 B.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from kvshare.cache.formats import DEFAULT_FORMATS, RowFormat, row_format
from kvshare.cache.regions import RegionMap
from kvshare.errors import ConfigError
from kvshare.topology import Topology

NULL_BLOCKS = 1  # block 0 is the null block of the pool: never holds a sequence's rows


@dataclass(frozen=True)
class Region:
    """Bytes ``[offset, offset + nbytes_padded)`` of every block: `rows` rows of `row_bytes` of `owner`."""

    owner: int
    kind: str
    offset: int
    rows: int
    row_bytes: int
    nbytes_padded: int

    @property
    def nbytes(self) -> int:
        """Payload bytes (without the alignment pad)."""
        return self.rows * self.row_bytes

    @property
    def end(self) -> int:
        return self.offset + self.nbytes_padded


def overlap_factor(arch: str, ratio: int) -> int:
    """coff: 2 for V4's overlapping ratio-4 compressors (each entry pools two groups of tokens with
    2x-wide projections), else 1. The one definition: the layout sizes rings with it and the
    model builds its compressors from it."""
    return 2 if arch == "v4" and ratio == 4 else 1


@dataclass(frozen=True)
class StateSpec:
    """One per-sequence ring: `tensors` tensors (1 window; 2 = kv and score) of `rows` x `row_bytes`.

    ``rows = depth + slack``: a read spans `depth` positions; `slack` rows serve speculation."""

    layer: int
    name: str  # "window" | "compressor" | "indexer_compressor"
    rows: int
    width: int  # values per row (per tensor)
    row_bytes: int
    tensors: int
    slack: int = 0

    @property
    def depth(self) -> int:
        return self.rows - self.slack

    @property
    def nbytes(self) -> int:
        return self.tensors * self.rows * self.row_bytes


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def _fmt(kind: str, f: str | RowFormat | None, cfg: Any) -> RowFormat:
    """The format named (or given) for `kind`; None picks the architecture's default."""
    if isinstance(f, RowFormat):
        return f
    if f is None:
        f = DEFAULT_FORMATS[cfg.arch][kind]
    dim = cfg.index_head_dim if kind == "index_k" else cfg.head_dim
    return row_format(kind, f, max(dim, 0), arch=cfg.arch, rope_dim=cfg.qk_rope_head_dim)


class CacheLayout:
    """The byte layout of one cache block plus per-sequence state sizes, for one Topology."""

    def __init__(
        self,
        topo: Topology,
        block_size: int = 128,
        kv_format: str | RowFormat | None = None,
        index_format: str | RowFormat | None = None,
        window_format: str | RowFormat | None = None,
        alignment: int = 32,
        state_dtype_bytes: int = 4,
        window_slack: int = 0,
        share_cache: bool | None = None,
        state_slack: int = 0,
    ) -> None:
        """`share_cache` None takes the Topology's mode."""
        cfg = topo.cfg
        self.topo = topo
        self.cfg = cfg
        self.share_cache = topo.share_cache if share_cache is None else bool(share_cache)
        self.regions_map = RegionMap(topo, self.share_cache)
        for name, v, lo in (("block_size", block_size, 1), ("alignment", alignment, 1),
                            ("state_dtype_bytes", state_dtype_bytes, 1), ("window_slack", window_slack, 0),
                            ("state_slack", state_slack, 0)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ConfigError(f"must be an integer >= {lo}, got {v!r}", field=name)
        for r in topo.ratios_in_use:
            if block_size % r:
                layer = next(p.layer for p in topo.layers if p.ratio == r)
                raise ConfigError(f"block_size {block_size} is not a multiple of compress ratio {r}",
                                  field="block_size", layer=layer,
                                  fix=f"use a multiple of every ratio in use {list(topo.ratios_in_use)}")
        self.block_size = block_size
        self.alignment = alignment
        self.state_dtype_bytes = state_dtype_bytes
        self.window_slack = window_slack
        self.state_slack = state_slack
        self.kv_format = _fmt("kv", kv_format, cfg)
        self.index_format = _fmt("index_k", index_format, cfg)
        self.window_format = _fmt("window", window_format, cfg)
        self.regions = self._carve()
        self._by_key = {(r.owner, r.kind): r for r in self.regions}
        self.bytes_per_block = self.regions[-1].end if self.regions else 0
        self.states = self._states()

    # ---- regions -------------------------------------------------------------------------------
    def _carve(self) -> tuple[Region, ...]:
        kv_owners = set(self.regions_map.kv_owners)
        ik_owners = set(self.regions_map.index_owners)
        out: list[Region] = []
        off = 0
        for owner in sorted(kv_owners | ik_owners):
            rows = self.block_size // self.topo[owner].ratio
            for kind, fmt, owners in (("index_k", self.index_format, ik_owners), ("kv", self.kv_format, kv_owners)):
                if owner not in owners:
                    continue
                padded = _align(rows * fmt.row_bytes, self.alignment)
                out.append(Region(owner, kind, off, rows, fmt.row_bytes, padded))
                off += padded
        return tuple(out)

    @property
    def owners(self) -> tuple[int, ...]:
        """Layers with at least one region, in layer order."""
        return tuple(dict.fromkeys(r.owner for r in self.regions))

    def region(self, owner: int, kind: str) -> Region:
        """The region owned by `owner` (KeyError if that layer owns no such region)."""
        try:
            return self._by_key[(owner, kind)]
        except KeyError:
            raise KeyError(f"layer {owner} owns no {kind!r} region in this layout") from None

    def reads_region(self, layer: int, kind: str) -> Region:
        """The region layer `layer` reads (KeyError if it reads none)."""
        return self.region(self.regions_map.reads(kind, layer), kind)

    def write_regions(self, layer: int, kind: str) -> tuple[Region, ...]:
        """The regions the rows computed by `layer` go to (CacheWriteError if it writes none)."""
        return tuple(self.region(o, kind) for o in self.regions_map.writes(kind, layer))

    def block_offset(self, block_id: int) -> int:
        """Byte offset of a block in the pool; a Python int (views must use int64)."""
        return block_id * self.bytes_per_block

    @property
    def bytes_per_token(self) -> float:
        """Block bytes per token position (padding included); 890.0 for V4.1-Flash fp4."""
        return self.bytes_per_block / self.block_size

    @property
    def payload_bytes_per_token(self) -> float:
        """Row bytes per token without alignment padding (V4-Flash: 3514.25)."""
        return sum(r.nbytes for r in self.regions) / self.block_size

    # ---- per-sequence state ----------------------------------------------------------------------
    def _states(self) -> tuple[StateSpec, ...]:
        cfg, sb = self.cfg, self.state_dtype_bytes
        out: list[StateSpec] = []
        w = self.window_format
        for p in self.topo.layers:  # draft windows get context rows only: drafts never write them
            slack = 0 if p.is_draft else self.window_slack
            out.append(StateSpec(p.layer, "window", cfg.sliding_window + slack, w.dim, w.row_bytes, 1, slack))
        slack = self.state_slack
        for p in self.topo.layers:
            coff = overlap_factor(cfg.arch, p.ratio)
            if p.needs_compressor_state:
                width = coff * cfg.head_dim
                out.append(StateSpec(p.layer, "compressor", coff * p.ratio + slack, width, width * sb, 2, slack))
            if p.needs_indexer_state:
                width = coff * cfg.index_head_dim
                out.append(StateSpec(p.layer, "indexer_compressor", coff * p.ratio + slack, width,
                                     width * sb, 2, slack))
        return tuple(out)

    def state_bytes(self, name: str | None = None, *, backbone_only: bool = False) -> int:
        """Per-sequence bytes of the rings called `name` (None: all)."""
        n = self.topo.num_layers
        return sum(s.nbytes for s in self.states
                   if (name is None or s.name == name) and (not backbone_only or s.layer < n))

    @property
    def window_bytes_per_seq(self) -> int:
        return self.state_bytes("window")

    @property
    def compressor_bytes_per_seq(self) -> int:
        return self.state_bytes("compressor") + self.state_bytes("indexer_compressor")

    @property
    def state_bytes_per_seq(self) -> int:
        """Everything one in-flight sequence holds outside the blocks."""
        return self.state_bytes()

    # ---- capacity ------------------------------------------------------------------------------
    def blocks_for_memory(self, memory_bytes: int, max_seqs: int = 1) -> int:
        """Blocks (null block included) that fit after `max_seqs` sequences' state; 0 if none."""
        if max_seqs < 0 or memory_bytes < 0:
            raise ValueError("memory_bytes and max_seqs must be non-negative")
        free = int(memory_bytes) - max_seqs * self.state_bytes_per_seq
        if free <= 0 or self.bytes_per_block == 0:
            return 0
        return free // self.bytes_per_block

    def tokens_for_memory(self, memory_bytes: int, max_seqs: int = 1) -> int:
        """Token positions the usable blocks (all but the null block) hold, across all sequences."""
        return max(0, self.blocks_for_memory(memory_bytes, max_seqs) - NULL_BLOCKS) * self.block_size

    # ---- comparison and identity ------------------------------------------------------------------
    @cached_property
    def unshared_layout(self) -> "CacheLayout":
        """Same formats and block size, but every compressed layer stores its own rows."""
        if not self.share_cache:
            return self
        return CacheLayout(self.topo, self.block_size, self.kv_format, self.index_format, self.window_format,
                           self.alignment, self.state_dtype_bytes, self.window_slack, share_cache=False,
                           state_slack=self.state_slack)

    def unshared(self) -> "CacheLayout":
        return self.unshared_layout

    @property
    def saving_factor(self) -> float:
        """Unshared bytes per block over shared bytes per block (11.6 for V4.1-Flash)."""
        u = self.unshared_layout.bytes_per_block
        return u / self.bytes_per_block if self.bytes_per_block else 1.0

    @cached_property
    def layout_id(self) -> str:
        """Readable prefix + digest of the full region table; equal ids mean byte-compatible blocks."""
        table = ";".join(f"{r.owner}.{r.kind}.{r.offset}.{r.rows}.{r.row_bytes}" for r in self.regions)
        digest = hashlib.sha1(table.encode()).hexdigest()[:12]
        share = "shared" if self.share_cache else "unshared"
        return (f"kvshare-v1-{self.cfg.arch}-bs{self.block_size}-a{self.alignment}-kv.{self.kv_format.label}"
                f"-ik.{self.index_format.label}-{share}-{digest}")

    def to_dict(self, memory_bytes: int | None = None, max_seqs: int = 1) -> dict[str, Any]:
        """JSON-able summary (what `kvshare plan --json` prints)."""
        fmt = {k: {"name": f.name, "dim": f.dim, "row_bytes": f.row_bytes, "block": f.block}
               for k, f in (("kv", self.kv_format), ("index_k", self.index_format), ("window", self.window_format))}
        d: dict[str, Any] = {
            "layout_id": self.layout_id,
            "share_cache": self.share_cache,
            "block_size": self.block_size,
            "alignment": self.alignment,
            "formats": fmt,
            "bytes_per_block": self.bytes_per_block,
            "bytes_per_token": self.bytes_per_token,
            "payload_bytes_per_token": self.payload_bytes_per_token,
            "unshared_bytes_per_block": self.unshared_layout.bytes_per_block,
            "unshared_bytes_per_token": self.unshared_layout.bytes_per_token,
            "saving_factor": self.saving_factor,
            "regions": [{"owner": r.owner, "kind": r.kind, "offset": r.offset, "end": r.end, "rows": r.rows,
                         "row_bytes": r.row_bytes, "nbytes_padded": r.nbytes_padded} for r in self.regions],
            "state_bytes_per_seq": self.state_bytes_per_seq,
            "window_bytes_per_seq": self.window_bytes_per_seq,
            "window_bytes_per_seq_backbone": self.state_bytes("window", backbone_only=True),
            "compressor_bytes_per_seq": self.compressor_bytes_per_seq,
        }
        if memory_bytes is not None:
            d["memory"] = {
                "memory_bytes": int(memory_bytes),
                "max_seqs": max_seqs,
                "state_bytes_total": max_seqs * self.state_bytes_per_seq,
                "blocks": self.blocks_for_memory(memory_bytes, max_seqs),
                "tokens": self.tokens_for_memory(memory_bytes, max_seqs),
                "unshared_tokens": self.unshared_layout.tokens_for_memory(memory_bytes, max_seqs),
            }
        return d
