"""Engram tables split by hash columns across tensor-parallel ranks (spec engram_dspark.md §1.11).

A layer's table is the concatenation of one sub-table per hash column (column c owns rows
``[offset_c, offset_c + prime_c)``, columns in n-gram-size-major order). Rank r of n owns the
contiguous columns ``[r C/n, (r+1) C/n)``, C = (engram_max_ngram_size - 1) x engram_n_heads, so
its rows are one contiguous range of the table: it keeps only those (a view of the memory map, or a
copy in ``memory`` mode, the full array released). In the forward every rank looks up its columns
for every token and the ranks all-gather the dequantised rows along the feature dim, in rank order
= column order: the gathered ``[T, C d_e]`` is bitwise TP=1's lookup (a gather and an exact
dequantisation, no arithmetic across ranks). ``wkv`` and the gates stay replicated.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torch import nn

from kvshare.config import ModelConfig
from kvshare.config.engram import engram_primes
from kvshare.errors import ConfigError
from kvshare.model.engram_table import ROW_BLOCK, EngramTable


def engram_cols(cfg: ModelConfig) -> int:
    """Hash columns of every Engram layer."""
    return (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads


def check_engram_divisible(cfg: ModelConfig, size: int) -> None:
    """ConfigError unless the hash columns split evenly over `size` ranks (no-op without Engram)."""
    if cfg.engram_layer_ids and engram_cols(cfg) % size:
        raise ConfigError(f"Engram's {engram_cols(cfg)} hash columns ((engram_max_ngram_size - 1) x engram_n_heads "
                          f"= ({cfg.engram_max_ngram_size} - 1) x {cfg.engram_n_heads}) are not divisible by "
                          f"tensor_parallel_size {size}", field="engram_n_heads",
                          fix="choose a tensor-parallel size that divides the hash columns")


def rank_columns(cfg: ModelConfig, rank: int, size: int) -> tuple[int, int]:
    """[lo, hi) of the hash columns rank `rank` of `size` owns."""
    n = engram_cols(cfg) // size
    return rank * n, (rank + 1) * n


def rank_rows(cfg: ModelConfig, rank: int, size: int) -> list[tuple[int, int]]:
    """Per Engram layer (config order), the [lo, hi) table rows rank `rank` of `size` owns."""
    lo, hi = rank_columns(cfg, rank, size)
    out = []
    for layer in engram_primes(cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads,
                               cfg.engram_vocab_size):
        primes = [p for size_primes in layer for p in size_primes]  # column order
        out.append((sum(primes[:lo]), sum(primes[:hi])))
    return out


def rank_table_bytes(cfg: ModelConfig, rank: int, size: int) -> int:
    """Bytes of the Engram table rows (FP8 codes + e8m0 row scales) rank `rank` of `size` holds."""
    d_e = cfg.engram_head_dim
    return sum((hi - lo) * (d_e + d_e // ROW_BLOCK) for lo, hi in rank_rows(cfg, rank, size))


def slice_table(table: EngramTable, lo: int, hi: int) -> EngramTable:
    """Rows [lo, hi) of `table`: a view of a memory map, a copy of an in-memory table."""
    if table.mode == "mmap":
        return EngramTable(table.codes[lo:hi], table.scales[lo:hi], table.mode)
    return EngramTable(np.array(table.codes[lo:hi]), np.array(table.scales[lo:hi]), table.mode)


def shard_engram(model: nn.Module, rank: int, size: int, group: Any) -> None:
    """Give each Engram layer of `model` its columns, its row base and the group's all-gather, and cut
    its table (if attached and still whole) to this rank's rows. Call again after attaching tables."""
    cfg = model.cfg
    if not cfg.engram_layer_ids or size == 1:
        return
    check_engram_divisible(cfg, size)
    lo, hi = rank_columns(cfg, rank, size)
    for (row_lo, row_hi), layer, rows in zip(rank_rows(cfg, rank, size), cfg.engram_layer_ids,
                                             cfg.engram_num_embeddings):
        engram = model.layers[layer].engram
        engram.tp_columns = (lo, hi, row_lo, group.all_gather)
        if engram.table is not None and engram.table.rows == rows:
            engram.table = slice_table(engram.table, row_lo, row_hi)
