"""ops.sparse_attention: equals a dense softmax with a sink column; empty rows give 0; ops.index_scores."""

from __future__ import annotations

import torch

from kvshare.ops import index_scores, sparse_attention


def test_matches_softmax_with_sink_column() -> None:
    g = torch.Generator().manual_seed(0)
    t, h, m, d = 5, 3, 7, 8
    q, kv = torch.randn(t, h, d, generator=g), torch.randn(t, m, d, generator=g)
    valid = torch.rand(t, m, generator=g) > 0.3
    valid[:, 0] = True
    sink = torch.randn(h, generator=g)
    got = sparse_attention(q, kv, valid, sink, 0.5)
    logits = torch.einsum("thd,tmd->thm", q, kv) * 0.5
    logits = logits.masked_fill(~valid[:, None], float("-inf"))
    full = torch.cat([logits, sink[None, :, None].expand(t, h, 1)], dim=-1).softmax(-1)[..., :-1]
    ref = torch.einsum("thm,tmd->thd", full, kv)
    assert torch.allclose(got, ref, atol=1e-6)


def test_all_masked_rows_give_zero_and_finite_grads() -> None:
    q = torch.randn(2, 2, 4, requires_grad=True)
    kv = torch.randn(2, 3, 4, requires_grad=True)
    valid = torch.tensor([[False, False, False], [True, False, True]])
    out = sparse_attention(q, kv, valid, torch.zeros(2), 1.0)
    assert torch.equal(out[0], torch.zeros(2, 4))
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(kv.grad).all()


def _index_ref(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """I[t, l] = sum_h w[t, h] relu(q[t, h] . k[seq t, l]) in float64, written out per the spec."""
    dots = torch.einsum("thd,tld->thl", q.double(), keys.double()[seq])
    return (torch.relu(dots) * w.double()[..., None]).sum(1)


def test_index_scores_fp32_formula() -> None:
    g = torch.Generator().manual_seed(1)
    t, h, d, n, length = 6, 8, 16, 2, 11
    q, w = torch.randn(t, h, d, generator=g), torch.randn(t, h, generator=g)
    keys = torch.randn(n, length, d, generator=g)
    seq = torch.tensor([0, 0, 0, 1, 1, 1])
    got = index_scores(q, w, keys, seq)
    assert got.dtype == torch.float32
    # fp32 accumulation: observed max |diff| 1.6e-6 on scores up to 36 (a few fp32 ulps)
    assert torch.allclose(got.double(), _index_ref(q, w, keys, seq), rtol=0, atol=5e-6)


def test_index_scores_float64_mode_is_batch_shape_invariant() -> None:
    g = torch.Generator().manual_seed(1)
    t, h, d, n, length = 6, 8, 16, 2, 11
    q = torch.randn(t, h, d, generator=g, dtype=torch.float64)
    w = torch.randn(t, h, generator=g, dtype=torch.float64)
    keys = torch.randn(n, length, d, generator=g, dtype=torch.float64)
    seq = torch.tensor([0, 0, 0, 1, 1, 1])
    got = index_scores(q, w, keys, seq)
    assert got.dtype == torch.float32
    assert torch.equal(got, _index_ref(q, w, keys, seq).float())  # one rounding of an fp64 sum
    for r in range(t):  # each row alone, and with a wider key tensor, gives bit-identical scores
        alone = index_scores(q[r:r + 1], w[r:r + 1], keys[seq[r]:seq[r] + 1], torch.tensor([0]))
        assert torch.equal(alone[0], got[r])
        wide = torch.cat([keys[seq[r]:seq[r] + 1], torch.zeros(1, 9, d, dtype=torch.float64)], dim=1)
        assert torch.equal(index_scores(q[r:r + 1], w[r:r + 1], wide, torch.tensor([0]))[0, :length], got[r])


def test_index_scores_do_not_depend_on_the_row_block_size() -> None:
    g = torch.Generator().manual_seed(2)
    f64 = torch.float64  # the exact mode; in fp32 the row blocks change the matmul shape
    q, w = torch.randn(37, 8, 16, generator=g, dtype=f64), torch.randn(37, 8, generator=g, dtype=f64)
    keys, seq = torch.randn(2, 50, 16, generator=g, dtype=f64), torch.randint(0, 2, (37,), generator=g)
    assert torch.equal(index_scores(q, w, keys, seq), index_scores(q, w, keys, seq, budget=1000))


def test_candidate_scores_score_only_the_masked_rows() -> None:
    from kvshare.ops.index_scores import candidate_scores

    g = torch.Generator().manual_seed(4)
    f64 = torch.float64
    t, h, d, n, length, cap = 7, 8, 16, 2, 40, 12
    q, w = torch.randn(t, h, d, generator=g, dtype=f64), torch.randn(t, h, generator=g, dtype=f64)
    keys = torch.randn(n, length, d, generator=g, dtype=f64)
    seq = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    mask = torch.zeros(t, length, dtype=torch.bool)
    for r in range(t):  # up to `cap` allowed rows per query row, the last row none
        if r < t - 1:
            mask[r, torch.randperm(length, generator=g)[: cap - r]] = True
    got = candidate_scores(q, w, keys, seq, mask, cap)
    ref = _index_ref(q, w, keys, seq).float()
    assert torch.equal(torch.isinf(got), ~mask)
    # float64 accumulation, one fp32 rounding: observed max |diff| 0 against the written-out formula
    assert torch.allclose(got[mask], ref[mask], rtol=0, atol=1e-6)
    alone = candidate_scores(q[2:3], w[2:3], keys[:1], torch.tensor([0]), mask[2:3], cap)
    assert torch.equal(alone[0], got[2])  # a row's scores do not depend on the batch
