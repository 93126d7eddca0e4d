"""ops.topk: causality, -1 padding, ascending order, ties toward the lower position, tie reports."""

from __future__ import annotations

import torch

from kvshare.ops import boundary_ties, select_topk, stable_topk
from kvshare.ops.topk import topk_mask


def test_ties_go_to_lower_positions() -> None:
    s = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0, 3.0]])
    assert stable_topk(s, 3)[1].tolist() == [[1, 2, 4]]
    assert select_topk(s, torch.tensor([6]), 3).tolist() == [[1, 2, 4]]
    assert boundary_ties(s, 3).tolist() == [True]
    assert boundary_ties(s, 4).tolist() == [False]


def test_causality_padding_and_order() -> None:
    s = torch.tensor([[5.0, 1.0, 4.0, 9.0, 9.0],
                      [0.0, 0.0, 0.0, 0.0, 0.0],
                      [2.0, 8.0, 1.0, 7.0, 3.0]])
    compress_len = torch.tensor([3, 0, 5])
    got = select_topk(s, compress_len, 4)
    assert got.tolist() == [[0, 1, 2, -1], [-1, -1, -1, -1], [0, 1, 3, 4]]


def test_minus_inf_scores_are_never_picked() -> None:
    s = torch.tensor([[1.0, float("-inf"), 2.0, float("-inf")]])
    assert select_topk(s, torch.tensor([4]), 3).tolist() == [[0, 2, -1]]


def test_k_wider_than_row_is_padded() -> None:
    s = torch.randn(2, 3)
    got = select_topk(s, torch.tensor([3, 2]), 6)
    assert got.shape == (2, 6)
    assert got[0, :3].tolist() == [0, 1, 2] and (got[0, 3:] == -1).all()
    assert got[1, :2].tolist() == [0, 1] and (got[1, 2:] == -1).all()


def test_matches_torch_topk_without_ties() -> None:
    g = torch.Generator().manual_seed(0)
    s = torch.randn(50, 40, generator=g)
    cl = torch.randint(0, 41, (50,), generator=g)
    got = select_topk(s, cl, 7)
    masked = s.masked_fill(torch.arange(40)[None] >= cl[:, None], float("-inf"))
    for r in range(50):
        n = min(7, int(cl[r]))
        ref = sorted(torch.topk(masked[r], n).indices.tolist()) if n else []
        assert got[r, :n].tolist() == ref and (got[r, n:] == -1).all()


def _reference_picks(row: list[float], length: int, k: int) -> list[int]:
    """The spec's rule written out: rank reachable finite entries by (-score, position), keep k, ascending."""
    ranked = sorted((-v, j) for j, v in enumerate(row[:length]) if v != float("-inf"))
    picks = sorted(j for _, j in ranked[:k])
    return picks + [-1] * (k - len(picks))


def test_tie_heavy_rows_match_the_written_out_rule() -> None:
    g = torch.Generator().manual_seed(3)
    for w, k in [(1, 1), (7, 3), (40, 8), (64, 64), (97, 16), (300, 50)]:
        s = torch.randint(0, 5, (12, w), generator=g).float()  # five distinct values: many ties
        s[torch.rand(12, w, generator=g) < 0.2] = float("-inf")
        lens = torch.randint(0, w + 1, (12,), generator=g)
        got = select_topk(s, lens, k).tolist()
        for r in range(12):
            assert got[r] == _reference_picks(s[r].tolist(), int(lens[r]), k), (w, k, r)
        mask = topk_mask(s, k)
        assert (mask.sum(-1) == min(k, w)).all()
