"""ops.candidates: block max, newest block pinned, top blocks, -inf blocks dropped, expansion."""

from __future__ import annotations

import torch

from kvshare.ops import block_scores, candidate_block_mask

NEG = float("-inf")


def test_block_scores_pad_with_minus_inf() -> None:
    s = torch.tensor([[1.0, 5.0, 2.0, 0.0, 7.0]])
    assert block_scores(s, 2).tolist() == [[5.0, 2.0, 7.0]]


def test_top_blocks_with_newest_pinned() -> None:
    # 12 positions, blocks of 3; compress_len 10 -> newest block 3 (positions 9..11, partially filled).
    s = torch.tensor([[9.0, 0, 0, 1, 1, 1, 0, 8, 0, 0.5, NEG, NEG]])
    mask = candidate_block_mask(s, torch.tensor([10]), block_size=3, topk_blocks=2)
    expect = [True] * 3 + [False] * 3 + [False] * 3 + [True] * 3
    assert mask.tolist() == [expect]


def test_unreachable_blocks_are_dropped_and_ties_prefer_lower_blocks() -> None:
    s = torch.tensor([[2.0, 2.0, 2.0, 2.0, NEG, NEG, NEG, NEG],
                      [NEG] * 8])
    mask = candidate_block_mask(s, torch.tensor([4, 0]), block_size=1, topk_blocks=3)
    # row 0: pin block 3; then the two best of the tied blocks 0..2 -> 0, 1; blocks 4.. unreachable.
    assert mask[0].tolist() == [True, True, False, True, False, False, False, False]
    assert not mask[1].any(), "compress_len 0: nothing pinned, nothing reachable"


def test_few_blocks_keep_everything_reachable() -> None:
    s = torch.randn(3, 7)
    cl = torch.tensor([7, 5, 2])
    s = s.masked_fill(torch.arange(7)[None] >= cl[:, None], NEG)
    mask = candidate_block_mask(s, cl, block_size=2, topk_blocks=8)
    for r in range(3):
        reach = int(cl[r])
        assert mask[r, :reach].all()
        # positions past compress_len are candidates only inside the newest (partial) block
        assert mask[r, reach:].sum() <= (-reach) % 2
