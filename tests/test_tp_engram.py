"""Engram tables split by hash columns under tensor parallelism (spec engram_dspark.md §1.11).

tiny-v41-engram: 2 Engram layers, (4 - 1) x 2 = 6 hash columns; at TP=2 rank r owns columns
[3r, 3r + 3) and only those columns' table rows. Each rank's Engram output (two ranks as threads,
the in-process all-gather) must equal the unsharded module bitwise: the lookup is a gather plus an
exact dequantisation, so nothing is summed across ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch

import tp_util
from kvshare.config import load_config
from kvshare.errors import ConfigError
from kvshare.parallel.engram_shard import check_engram_divisible, rank_rows, rank_table_bytes, shard_engram

NAME = "tiny-v41-engram"


def test_rank_rows_are_the_owned_columns_sub_tables() -> None:
    cfg = load_config(NAME)
    model = tp_util.tiny(NAME)
    layout = model.engram_hash.layout
    for i, n in enumerate(cfg.engram_num_embeddings):
        primes = layout.primes[i].tolist()
        # written out: columns 0-2 start at row 0, columns 3-5 start after the first three sub-tables
        assert rank_rows(cfg, 0, 2)[i] == (0, primes[0] + primes[1] + primes[2])
        assert rank_rows(cfg, 1, 2)[i] == (primes[0] + primes[1] + primes[2], n)
        assert rank_rows(cfg, 1, 3)[i] == (sum(primes[:2]), sum(primes[:4]))
    d_e = cfg.engram_head_dim
    assert rank_table_bytes(cfg, 0, 2) + rank_table_bytes(cfg, 1, 2) == sum(cfg.engram_num_embeddings) * (d_e + d_e // 32)


def test_indivisible_columns_name_the_field() -> None:
    cfg = load_config(NAME)
    with pytest.raises(ConfigError) as e:
        check_engram_divisible(cfg, 4)  # 6 columns over 4 ranks
    assert e.value.field == "engram_n_heads"
    check_engram_divisible(cfg, 3)
    check_engram_divisible(load_config("tiny-v41"), 4)  # no Engram: nothing to split


def test_sharded_engram_equals_tp1_bitwise() -> None:
    torch.manual_seed(0)
    model = tp_util.tiny(NAME)
    cfg = model.cfg
    t = 11
    ids = torch.randint(0, cfg.vocab_size, (t, cfg.engram_max_ngram_size))
    rows = model.engram_hash(ids, torch.ones_like(ids, dtype=torch.bool))  # [T, L, cols]
    h = torch.randn(t, cfg.hc_mult, cfg.hidden_size)
    for i, layer in enumerate(cfg.engram_layer_ids):
        full = model.layers[layer].engram
        want = full(h, rows[:, i])

        def rank_forward(group: tp_util.ThreadGroup) -> tuple[int, torch.Tensor]:
            shard = copy.deepcopy(model)
            shard_engram(shard, group.rank, 2, group)
            return shard.layers[layer].engram.table.rows, shard.layers[layer].engram(h, rows[:, i])

        (kept0, got0), (kept1, got1) = tp_util.run_ranks(2, rank_forward)
        assert [kept0, kept1] == [hi - lo for lo, hi in (rank_rows(cfg, r, 2)[i] for r in range(2))]  # only its rows
        assert torch.equal(got0, want) and torch.equal(got1, want)  # bitwise; observed 0 difference
        assert not torch.equal(want, h)  # the Engram add did something


def test_sliced_loader_keeps_only_the_rank_rows(tmp_path) -> None:
    """A rank loaded from a checkpoint keeps its columns' rows, equal to the checkpoint's (both modes)."""
    from kvshare.engine.args import EngineArgs
    from kvshare.weights.loader import load_model
    from kvshare.weights.checkpoint_write import save_checkpoint
    from kvshare.parallel.loader import load_rank_model

    full = load_model(NAME, quant=False)
    ck = save_checkpoint(full, full.cfg, tmp_path / NAME)
    cfg = full.cfg
    for mode in ("mmap", "memory"):
        args = EngineArgs(dtype="float32", quantize=False, engram_table=mode)
        rank1 = load_rank_model(str(ck), args, tp_util.ThreadGroup(1, tp_util.ThreadHub(2)))
        for i, layer in enumerate(cfg.engram_layer_ids):
            lo, hi = rank_rows(cfg, 1, 2)[i]
            got, want = rank1.layers[layer].engram.table, full.layers[layer].engram.table
            assert got.rows == hi - lo and got.mode == mode
            assert (got.codes == want.codes[lo:hi]).all() and (got.scales == want.scales[lo:hi]).all()
            assert rank1.layers[layer].engram.tp_columns[:3] == (3, 6, lo)
