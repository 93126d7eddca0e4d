"""ops.prefix_attention: banded window + per-sequence compressed rows equal the §4.7 formula per row."""

from __future__ import annotations

import math

import pytest
import torch

from kvshare.ops.prefix_attention import picks_to_mask, prefix_attention, window_keys


def _row_reference(q: torch.Tensor, keys: list[torch.Tensor], sink: torch.Tensor, scale: float) -> torch.Tensor:
    """o_h = sum_i e^{s_i - m} k_i / (sum_i e^{s_i - m} + e^{sink_h - m}), written out per head."""
    out = torch.zeros_like(q)
    for h in range(q.shape[0]):
        s = [float(q[h] @ k) * scale for k in keys]
        m = max(s + [float(sink[h])])
        num = sum((math.exp(si - m) * k for si, k in zip(s, keys)), torch.zeros_like(q[h]))
        out[h] = num / (sum(math.exp(si - m) for si in s) + math.exp(float(sink[h]) - m))
    return out


# lens [5, 1, 7]: a fresh prompt, a decode row, a later chunk (rows regrouped into padded blocks);
# lens [4, 4, 4] with a block dividing 4: rows already in [N, S] order (the no-copy path)
@pytest.mark.parametrize("block,lens", [(1, [5, 1, 7]), (3, [5, 1, 7]), (64, [5, 1, 7]), (2, [4, 4, 4]),
                                        (4, [4, 4, 4])])
def test_matches_the_formula_row_by_row(block: int, lens: list[int]) -> None:
    g = torch.Generator().manual_seed(0)
    f64 = torch.float64
    w, h, d, n_comp = 4, 3, 8, 6
    starts = [0, 2, 9]
    seq_index = torch.tensor([i for i, n in enumerate(lens) for _ in range(n)])
    rank = torch.tensor([r for n in lens for r in range(n)])
    t = len(seq_index)
    full = [torch.randn(s + n, d, generator=g, dtype=f64) for s, n in zip(starts, lens)]  # every position's row
    comp = torch.randn(3, n_comp, d, generator=g, dtype=f64)
    q = torch.randn(t, h, d, generator=g, dtype=f64)
    sink = torch.randn(h, generator=g, dtype=f64)
    picks = torch.randint(-1, n_comp, (t, 3), generator=g)
    prior = torch.zeros(3, w - 1, d, dtype=f64)
    for i, s in enumerate(starts):
        for k in range(w - 1):
            p = s - (w - 1) + k
            if p >= 0:
                prior[i, k] = full[i][p]
    values = torch.cat([full[i][s:] for i, s in enumerate(starts)])
    keys = window_keys(prior, values, seq_index, rank, max(lens))
    got = prefix_attention(q, keys, torch.tensor(starts), comp, picks_to_mask(picks, n_comp), seq_index, rank,
                           sink, 0.7, block=block)
    for row in range(t):
        i, p = int(seq_index[row]), starts[int(seq_index[row])] + int(rank[row])
        rows = [full[i][j] for j in range(max(0, p - w + 1), p + 1)]
        rows += [comp[i, j] for j in sorted({int(j) for j in picks[row] if j >= 0})]
        ref = _row_reference(q[row], rows, sink, 0.7)
        assert torch.allclose(got[row], ref, atol=1e-12), row  # float64: observed max |diff| 1.1e-15


def test_rows_with_nothing_to_attend_give_zero() -> None:
    q = torch.randn(2, 2, 4)
    keys = window_keys(torch.zeros(2, 0, 4), torch.zeros(2, 4), torch.tensor([0, 1]), torch.tensor([0, 0]), 1)
    out = prefix_attention(q, keys, torch.tensor([0, 0]), None, None, torch.tensor([0, 1]), torch.tensor([0, 0]),
                           torch.zeros(2), 1.0)
    assert torch.equal(out, torch.zeros(2, 2, 4))  # the only key is a zero row: weight / (weight + sink) * 0


def test_inference_in_place_equals_autograd_path_bit_for_bit() -> None:
    """Without autograd the score blocks are rewritten in place; with it, out of place: same bits."""
    g = torch.Generator().manual_seed(1)
    n, s_len, h, d, p_len, n_comp = 2, 4, 2, 8, 3, 5
    q = torch.randn(n * s_len, h, d, generator=g)
    win = torch.randn(n, p_len + s_len, d, generator=g)
    comp = torch.randn(n, n_comp, d, generator=g)
    mask = picks_to_mask(torch.randint(-1, n_comp, (n * s_len, 3), generator=g), n_comp)
    seq_index, rank = torch.arange(n).repeat_interleave(s_len), torch.arange(s_len).repeat(n)
    sink = torch.randn(h, generator=g, requires_grad=True)
    args = (win, torch.tensor([0, 6]), comp, mask, seq_index, rank, sink, 0.5)
    with torch.inference_mode():
        fast = prefix_attention(q, *args, block=2)
    slow = prefix_attention(q.requires_grad_(), *args, block=2)
    slow.sum().backward()
    assert torch.equal(fast, slow.detach())
    assert q.grad is not None and sink.grad is not None and bool(torch.isfinite(q.grad).all())
