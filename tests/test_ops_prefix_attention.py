"""ops.prefix_attention: banded window + per-sequence compressed rows equal the §4.7 formula per row."""

from __future__ import annotations

import math

import pytest
import torch

import kvshare.ops.prefix_attention as prefix_module
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
# lens [4, 4, 4] with a block dividing 4: rows already in [N, S] order (the no-copy path).
# by_sequence: False = banded blocks only, True = one sequence at a time only, None = the default
# choice with BY_SEQUENCE_MIN_ROWS 5 (sequences 0 and 2 on their own, the decode row banded).
@pytest.mark.parametrize("block,lens,by_sequence", [
    (1, [5, 1, 7], False), (3, [5, 1, 7], False), (64, [5, 1, 7], False), (2, [4, 4, 4], False),
    (4, [4, 4, 4], False), (64, [5, 1, 7], True), (2, [4, 4, 4], True), (3, [5, 1, 7], None)])
def test_matches_the_formula_row_by_row(block: int, lens: list[int], by_sequence: bool | None,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix_module, "BY_SEQUENCE_MIN_ROWS", 5)
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
                           sink, 0.7, block=block, by_sequence=by_sequence)
    for row in range(t):
        i, p = int(seq_index[row]), starts[int(seq_index[row])] + int(rank[row])
        rows = [full[i][j] for j in range(max(0, p - w + 1), p + 1)]
        rows += [comp[i, j] for j in sorted({int(j) for j in picks[row] if j >= 0})]
        ref = _row_reference(q[row], rows, sink, 0.7)
        assert torch.allclose(got[row], ref, atol=1e-12), row  # float64: observed max |diff| 1.1e-15


@pytest.mark.parametrize("by_sequence", [False, True])
def test_rows_with_nothing_to_attend_give_zero(by_sequence: bool) -> None:
    q = torch.randn(2, 2, 4)
    keys = window_keys(torch.zeros(2, 0, 4), torch.zeros(2, 4), torch.tensor([0, 1]), torch.tensor([0, 0]), 1)
    out = prefix_attention(q, keys, torch.tensor([0, 0]), None, None, torch.tensor([0, 1]), torch.tensor([0, 0]),
                           torch.zeros(2), 1.0, by_sequence=by_sequence)
    assert torch.equal(out, torch.zeros(2, 2, 4))  # the only key is a zero row: weight / (weight + sink) * 0


@pytest.mark.parametrize("by_sequence", [False, True])
def test_inference_in_place_equals_autograd_path_bit_for_bit(by_sequence: bool) -> None:
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
        fast = prefix_attention(q, *args, block=2, by_sequence=by_sequence)
    slow = prefix_attention(q.requires_grad_(), *args, block=2, by_sequence=by_sequence)
    slow.sum().backward()
    assert torch.equal(fast, slow.detach())
    assert q.grad is not None and sink.grad is not None and bool(torch.isfinite(q.grad).all())


def test_a_sequence_gives_the_same_bits_alone_and_in_a_mixed_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The path (own / banded) follows the sequence's own length, so batching never changes its bits."""
    monkeypatch.setattr(prefix_module, "BY_SEQUENCE_MIN_ROWS", 4)
    g = torch.Generator().manual_seed(2)
    lens, starts, w, h, d, n_comp = [6, 2, 4, 1], [0, 5, 70, 3], 5, 2, 8, 4  # sequences 1, 3 banded
    seq_index = torch.tensor([i for i, n in enumerate(lens) for _ in range(n)])
    rank = torch.tensor([r for n in lens for r in range(n)])
    q = torch.randn(len(seq_index), h, d, generator=g)
    values = torch.randn(len(seq_index), d, generator=g)
    prior = torch.randn(len(lens), w - 1, d, generator=g)
    comp = torch.randn(len(lens), n_comp, d, generator=g)
    mask = picks_to_mask(torch.randint(-1, n_comp, (len(seq_index), 2), generator=g), n_comp)
    sink = torch.randn(h, generator=g)
    keys = window_keys(prior, values, seq_index, rank, max(lens))
    both = prefix_attention(q, keys, torch.tensor(starts), comp, mask, seq_index, rank, sink, 0.3)
    for i, n in enumerate(lens):
        rows = seq_index == i
        alone_keys = window_keys(prior[i:i + 1], values[rows], torch.zeros(n, dtype=torch.long), rank[rows], n)
        alone = prefix_attention(q[rows], alone_keys, torch.tensor(starts[i:i + 1]), comp[i:i + 1], mask[rows],
                                 torch.zeros(n, dtype=torch.long), rank[rows], sink, 0.3)
        assert torch.equal(both[rows], alone), i
