"""Topology: who owns what, and whose cache each layer reads (the seed's source maps).

Resolved once from a ModelConfig; pure Python, no torch.

Roles (spec/model.md §2):

* ``SWA``     ratio 0 (and every draft layer): only its own sliding-window ring.
* ``FULL``    a kv source: compressor, compressed-KV cache, index-K cache, indexer. In V4 every
              compressed layer is FULL (its own source); V4 ratio-128 layers have no indexer.
* ``REINDEX`` an index source that is not a kv source: own index queries and top-k, scored against
              its index-K owner's cache, attends over its kv source's compressed KV.
* ``REUSE``   neither: takes its index source's published top-k and its kv source's compressed KV.

Source rule: ``source(l) = max{s in sources : s <= l}``, only for layers with ratio > 0.

Cache regions are not decided here: `kvshare.cache.regions.RegionMap` resolves which region each
layer reads and writes, shared or not. ``share_cache`` only records the cache mode a CacheLayout
built on this Topology uses by default; the model's wiring and maths never depend on it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property

from kvshare.config import ModelConfig
from kvshare.errors import ConfigError


class Role(str, enum.Enum):
    SWA = "swa"
    FULL = "full"
    REINDEX = "reindex"
    REUSE = "reuse"


@dataclass(frozen=True)
class LayerPlan:
    """Everything about one layer's attention wiring.

    Invariants: ``kv_source``, ``index_source``, ``index_k_source`` are None for ratio-0 layers;
    otherwise they are layers at or before this one with the same ratio. ``index_source`` is None
    only for V4 ratio-128 layers (which attend every causal compressed entry).
    """

    layer: int
    ratio: int
    role: Role
    kv_source: int | None
    index_source: int | None
    index_k_source: int | None
    candidate_source: int | None
    is_kv_source: bool
    is_index_source: bool
    is_index_k_source: bool
    publishes_candidates: bool
    uses_candidates: bool
    needs_compressor_state: bool
    needs_indexer_state: bool
    is_draft: bool

    @property
    def is_compressed(self) -> bool:
        return self.ratio > 0

    @property
    def has_index_topk(self) -> bool:
        """Whether this layer attends a top-k selection (False: window only, or V4 HCA all-entries)."""
        return self.index_source is not None


@dataclass(frozen=True)
class CandidateConfig:
    """Two-level selection published by the candidate source (block score = max over the block)."""

    source: int
    topk_blocks: int
    block_size: int
    reduce: str = "max"


def _latest(sources: tuple[int, ...], layer: int) -> int | None:
    prior = [s for s in sources if s <= layer]
    return max(prior) if prior else None


class Topology:
    """Per-layer plans for the backbone and the draft layers, plus the cache-owner lists."""

    def __init__(self, cfg: ModelConfig, *, share_cache: bool = True) -> None:
        self.cfg = cfg
        self.share_cache = share_cache
        self.candidate: CandidateConfig | None = None
        if cfg.arch == "v4":
            self.layers = tuple(_v4_plan(cfg, layer) for layer in range(len(cfg.compress_ratios)))
        else:
            self.layers = _v41_plans(cfg, self)

    def __getitem__(self, layer: int) -> LayerPlan:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def num_layers(self) -> int:
        """Backbone layers (draft layers are listed after them in ``layers``)."""
        return self.cfg.num_hidden_layers

    @cached_property
    def ratios_in_use(self) -> tuple[int, ...]:
        return tuple(sorted({p.ratio for p in self.layers if p.ratio > 0}))

    def summary_counts(self) -> dict[str, int]:
        counts = {r.value: 0 for r in Role}
        for p in self.layers[: self.num_layers]:
            counts[p.role.value] += 1
        return counts


# ---- V4 -----------------------------------------------------------------------------------------


def _v4_plan(cfg: ModelConfig, layer: int) -> LayerPlan:
    draft = layer >= cfg.num_hidden_layers
    r = cfg.compress_ratios[layer]
    if r == 0:
        return _swa_plan(layer, draft)
    csa = r == 4
    return LayerPlan(
        layer=layer, ratio=r, role=Role.FULL, kv_source=layer,
        index_source=layer if csa else None, index_k_source=layer if csa else None, candidate_source=None,
        is_kv_source=True, is_index_source=csa, is_index_k_source=csa,
        publishes_candidates=False, uses_candidates=False,
        needs_compressor_state=True, needs_indexer_state=csa, is_draft=False,
    )


def _swa_plan(layer: int, draft: bool) -> LayerPlan:
    return LayerPlan(
        layer=layer, ratio=0, role=Role.SWA, kv_source=None, index_source=None, index_k_source=None,
        candidate_source=None, is_kv_source=False, is_index_source=False, is_index_k_source=False,
        publishes_candidates=False, uses_candidates=False, needs_compressor_state=False,
        needs_indexer_state=False, is_draft=draft,
    )


# ---- V4.1 ---------------------------------------------------------------------------------------


def _check_ids(cfg: ModelConfig, name: str, ids: tuple[int, ...]) -> None:
    n = cfg.num_hidden_layers
    total = len(cfg.compress_ratios)
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ConfigError("lists a layer twice", field=name, layer=dup, fix="remove the duplicate")
    for s in ids:
        if not 0 <= s < total:
            raise ConfigError(f"layer id {s} is out of range [0, {n})", field=name, layer=s,
                              fix=f"use backbone layer ids below num_hidden_layers={n}")
        if s >= n:
            raise ConfigError("sharing on MTP/draft layers is not supported", field=name, layer=s,
                              fix=f"list only backbone layers (< {n})")
        if cfg.compress_ratios[s] == 0:
            raise ConfigError("a source layer must have compress ratio > 0, this layer has ratio 0",
                              field=name, layer=s, fix="list only compressed layers as sources")


def _same_ratio_source(cfg: ModelConfig, sources: tuple[int, ...], field: str, what: str, layer: int,
                       mismatch_field: str) -> int:
    """The latest source at or before `layer`; it must exist and have the layer's ratio."""
    r = cfg.compress_ratios[layer]
    src = _latest(sources, layer)
    if src is None:
        raise ConfigError(f"compressed layer (ratio {r}) has no {what} source at or before it", field=field,
                          layer=layer, fix=f"add a {what} source at or before layer {layer}")
    if cfg.compress_ratios[src] != r:
        raise ConfigError(f"ratio {r} differs from its {what} source {src}'s ratio {cfg.compress_ratios[src]}",
                          field=mismatch_field, layer=layer,
                          fix=f"add a {what} source of ratio {r} at or before layer {layer}, "
                              f"or give it ratio {cfg.compress_ratios[src]}")
    return src


def _v41_plans(cfg: ModelConfig, topo: Topology) -> tuple[LayerPlan, ...]:
    n = cfg.num_hidden_layers
    kv = tuple(sorted(cfg.kv_source_layer_ids))
    idx = tuple(sorted(cfg.index_source_layer_ids))
    _check_ids(cfg, "kv_source_layer_ids", kv)
    _check_ids(cfg, "index_source_layer_ids", idx)
    ik_field = "index_k_source_layer_ids"
    ik = tuple(sorted(cfg.index_k_source_layer_ids)) if cfg.index_k_source_layer_ids is not None else kv
    _check_ids(cfg, ik_field, ik)
    for s in kv:
        if s not in idx:
            raise ConfigError("every kv source must also be an index source (else its index keys are never "
                              "computed)", field="kv_source_layer_ids", layer=s,
                              fix=f"add {s} to index_source_layer_ids")
    for s in ik:
        if s not in kv or s not in idx:
            raise ConfigError("an index-K source must be both a kv source and an index source",
                              field=ik_field, layer=s, fix="list only layers that are in both source lists")

    cand = cfg.candidate_source_layer_id
    if cand >= 0:
        if cand >= n or cand not in idx:
            raise ConfigError("the candidate source must be an index source", field="candidate_source_layer_id",
                              layer=cand, fix="pick a layer from index_source_layer_ids, or -1 to disable")
        if cfg.candidate_topk_blocks <= 0 or cfg.candidate_block_size <= 0:
            raise ConfigError("candidate blocks need candidate_topk_blocks > 0 and candidate_block_size > 0",
                              field="candidate_topk_blocks", layer=cand)
        if (cfg.candidate_topk_blocks - 1) * cfg.candidate_block_size + 1 < cfg.index_topk:
            raise ConfigError(
                f"(candidate_topk_blocks - 1) * candidate_block_size + 1 = "
                f"{(cfg.candidate_topk_blocks - 1) * cfg.candidate_block_size + 1} < index_topk {cfg.index_topk}; "
                "top-k would fall back on entries outside the candidate pool",
                field="candidate_topk_blocks", layer=cand, fix="raise candidate_topk_blocks or block size")
        topo.candidate = CandidateConfig(cand, cfg.candidate_topk_blocks, cfg.candidate_block_size)

    plans: list[LayerPlan] = []
    for layer in range(len(cfg.compress_ratios)):
        r = cfg.compress_ratios[layer]
        if layer >= n or r == 0:
            plans.append(_swa_plan(layer, layer >= n))
            continue
        ks = _same_ratio_source(cfg, kv, "kv_source_layer_ids", "kv", layer, "compress_ratios")
        isrc = _same_ratio_source(cfg, idx, "index_source_layer_ids", "index", layer,
                                  "index_source_layer_ids")
        is_idx = layer in idx
        iks = None
        if is_idx:
            iks = _latest(ik, layer)
            if iks is None or cfg.compress_ratios[iks] != r:
                raise ConfigError(f"index source has no index-K owner of ratio {r} at or before it",
                                  field=ik_field, layer=layer,
                                  fix=f"add a kv source of ratio {r} at or before layer {layer}")
        is_kv = layer in kv
        uses_cand = is_idx and 0 <= cand < layer
        if uses_cand and cfg.compress_ratios[cand] != r:
            raise ConfigError(f"consumes candidates from layer {cand} of ratio {cfg.compress_ratios[cand]} "
                              f"but has ratio {r}", field="candidate_source_layer_id", layer=layer,
                              fix="candidate consumers must share the candidate source's ratio")
        role = Role.FULL if is_kv else (Role.REINDEX if is_idx else Role.REUSE)
        plans.append(LayerPlan(
            layer=layer, ratio=r, role=role, kv_source=ks, index_source=isrc,
            index_k_source=iks, candidate_source=cand if uses_cand else None,
            is_kv_source=is_kv, is_index_source=is_idx, is_index_k_source=layer in ik,
            publishes_candidates=layer == cand, uses_candidates=uses_cand,
            needs_compressor_state=is_kv and r > 1, needs_indexer_state=False, is_draft=False,
        ))
    return tuple(plans)
