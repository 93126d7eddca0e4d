"""Native lightning-indexer scores + top-k (kernels/attn.index_topk, csrc/index.cpp, issue 26).

The kernel sums the scores in its own order (csrc/index.h), so its picks are compared with the
torch path's selection (`ops.topk.select_topk`) over scores written out here in float64 from the
spec's formula: equal wherever the k-th and (k+1)-th scores are further apart than fp32 rounding
(asserted per row, so a near-tie cannot make the test pass or fail by luck); ties (identical key rows
give identical scores in both) go to the lower entry. The pool-in-place and gathered-key variants
give the same picks, and a row alone gives its picks in a call of many rows. End to end, a paged
engine's indexer calls give the torch path's picks on every call (the torch selection recomputed
beside each native one).

Mutations caught (each run by hand while writing this): ties to the higher entry (``a > b`` in the
comparator: the tie test), ReLU dropped (the formula tests at k = 1 and 7, both engine tests), the
table row ``(pos % B) / ratio`` replaced by ``pos % (B / ratio)`` (the pool tests, both engine
tests), the causal count ignored for gathered keys (``n = dense_rows``: the formula tests at k = 64,
the pool tests).
"""

from __future__ import annotations


import pytest
import torch

from kvshare.config import load_config
from kvshare.engine.engine import LLMEngine
from kvshare.kernels import decode as native
from kvshare.kernels.attn import index_topk
from kvshare.model import Transformer
from kvshare.layers.index_select import IndexSelect
from kvshare.ops.topk import select_topk

from test_engine_exact import greedy_random_run

pytestmark = pytest.mark.skipif(not native.enabled(), reason="native kernels unavailable on this machine")


def _exact_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """[T, L] float64: sum_h w[t, h] relu(q[t, h] . keys[seq[t], j]) (spec/model.md §4.6)."""
    dots = torch.einsum("thd,tld->thl", q.double(), keys[seq].double())
    return torch.einsum("thl,th->tl", dots.clamp(min=0), w.double())


def _data(dtype: torch.dtype, t: int, n_seq: int, length: int, seed: int, h: int = 4, d: int = 32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g)
    w = torch.randn(t, h, generator=g)
    keys = torch.randn(n_seq, length, d, generator=g).to(dtype)
    seq = torch.randint(0, n_seq, (t,), generator=g)
    counts = torch.randint(0, length + 1, (t,), generator=g)
    return q, w, keys, seq, counts


def _check_against_exact(picks: torch.Tensor, exact: torch.Tensor, counts: torch.Tensor, k: int) -> int:
    """Asserts picks == select_topk over the exact scores on every row whose k-boundary is not a
    near-tie (gap > 1e-5 relative); returns how many rows were compared."""
    want = select_topk(exact.float(), counts, k)
    masked = exact.masked_fill(torch.arange(exact.shape[1])[None, :] >= counts[:, None], float("-inf"))
    compared = 0
    for r in range(picks.shape[0]):
        row = masked[r].sort(descending=True).values
        if counts[r] > k and (row[k - 1] - row[k]).abs() <= 1e-5 * row[:k].abs().max():
            continue
        assert torch.equal(picks[r], want[r]), r
        compared += 1
    return compared


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [1, 7, 64])
def test_picks_are_the_top_k_of_the_formula(dtype: torch.dtype, k: int) -> None:
    q, w, keys, seq, counts = _data(dtype, 37, 3, 50, seed=k)
    picks = index_topk(q, w, keys, dtype, seq, counts, k)
    compared = _check_against_exact(picks, _exact_scores(q, w, keys, seq), counts, k)
    assert compared >= 35  # observed: 37 of 37 rows (no near-tie at these seeds)
    for r in (0, 11, 36):  # a row alone
        assert torch.equal(index_topk(q[r:r + 1], w[r:r + 1], keys, dtype, seq[r:r + 1], counts[r:r + 1], k), picks[r:r + 1])


def test_ties_go_to_the_lower_entry() -> None:
    """Keys 3, 9 and 14 are one row (identical scores); with k = 2 the two lower ones are picked."""
    g = torch.Generator().manual_seed(1)
    q, w = torch.randn(2, 2, 16, generator=g), torch.rand(2, 2, generator=g) + 0.1
    keys = torch.randn(1, 16, 16, generator=g) * 0.01  # small: the tied row is the clear maximum
    for j in (3, 9, 14):
        keys[0, j] = q[0].sum(0) + q[1].sum(0)
    seq, counts = torch.zeros(2, dtype=torch.int64), torch.tensor([16, 16])
    picks = index_topk(q, w, keys, torch.float32, seq, counts, 2)
    exact = _exact_scores(q, w, keys, seq)
    assert exact[:, 3].equal(exact[:, 9]) and (exact[:, 3] > exact[:, [0, 1, 2, 4]].max(1).values).all()
    assert picks.tolist() == [[3, 9], [3, 9]]
    assert torch.equal(picks, select_topk(exact.float(), counts, 2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pool_in_place_gives_the_gathered_picks(dtype: torch.dtype) -> None:
    """The same keys stored in a paged pool (ratio 4, blocks of 16 tokens = 4 rows, rows padded
    past their values, a region inside wider blocks) and addressed through block tables."""
    q, w, keys, seq, counts = _data(dtype, 21, 3, 20, seed=5)
    esz, d, per, bsz, ratio = keys.element_size(), keys.shape[-1], 4, 16, 4
    tables = torch.tensor([[5, 2, 7, 1, 3], [4, 6, 8, 9, 10], [11, 12, 13, 14, 15]])
    blocks = torch.zeros(16, 64 + per * (d * esz + 8), dtype=torch.uint8)
    view = torch.as_strided(blocks, (16, per, d * esz + 8), (blocks.stride(0), d * esz + 8, 1), 29)
    for s in range(3):
        for j in range(20):
            p = j * ratio
            view[tables[s, p // bsz], (p % bsz) // ratio, :d * esz] = keys[s, j].view(torch.uint8)
    got = index_topk(q, w, view, dtype, seq, counts, 6, tables, ratio, bsz)
    assert torch.equal(got, index_topk(q, w, keys, dtype, seq, counts, 6))
    with pytest.raises(RuntimeError, match="block table entry 99"):
        index_topk(q, w, view, dtype, seq, counts, 6, tables.index_fill(1, torch.tensor([2]), 99), ratio, bsz)
    with pytest.raises(RuntimeError, match="outside the keys"):
        index_topk(q, w, keys, dtype, seq, counts + 21, 6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_engine_native_picks_equal_the_torch_selection(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """`IndexSelect`'s native selection against its row-invariant torch one: tiny-v4 (k = 4, so every
    step past 16 tokens scores), each native selection of a paged, batched, chunked run is compared
    with the torch selection over the same inputs, bitwise. Mutation caught (both dtypes): the
    native selection given the causal counts minus one (``pre.compress_len - 1`` in `native_scores`)."""
    model = Transformer(load_config("tiny-v4"), quant=False).init_weights(2).eval().to(dtype)
    real = IndexSelect.native_scores
    calls = []

    def both(self, ctx, q, w):
        got = real(self, ctx, q, w)
        calls.append(torch.equal(got, self.scored(ctx, q, w, rows_alone=True)))
        return got

    monkeypatch.setattr(IndexSelect, "native_scores", both)
    # the fused query call (tests/test_indexer_fused.py) would stand for native_scores: off here
    eng = LLMEngine(model, batch_invariant=True, quantize=False, dtype=str(dtype).split(".")[1], block_size=128,
                    num_blocks=10, max_num_seqs=3, max_num_batched_tokens=17,
                    kernel_overrides={"fused_attn_proj": False})
    greedy_random_run(eng, model.cfg.vocab_size, (40, 9, 27), seed=6)
    assert len(calls) >= 2 * 10 and all(calls)
