"""model.rope.RotaryEmbedding.rotate: the interleaved partial rotation of spec/model.md §4.2.

The reference is written per element with Python floats: pair (a, b) = (x[2i], x[2i+1]) of the
rope tail becomes (a cos - b sin, a sin + b cos) at angle pos * f_i; the head dims are untouched.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvshare.layers.rope import RotaryEmbedding

RD, BASE = 8, 100.0


def _reference(x: torch.Tensor, pos: list[int], inverse: bool = False) -> torch.Tensor:
    """float64 per element; x [T, H, d] with positions per T."""
    out = x.double().clone()
    d = x.shape[-1]
    for t, p in enumerate(pos):
        for h in range(x.shape[1]):
            for i in range(RD // 2):
                ang = p * BASE ** (-2.0 * i / RD) * (-1 if inverse else 1)
                a, b = float(x[t, h, d - RD + 2 * i]), float(x[t, h, d - RD + 2 * i + 1])
                out[t, h, d - RD + 2 * i] = a * math.cos(ang) - b * math.sin(ang)
                out[t, h, d - RD + 2 * i + 1] = a * math.sin(ang) + b * math.cos(ang)
    return out


def _fp32_formula(x: torch.Tensor, pos: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """The same complex product with separate fp32 tensors for a, b, cos, sin (one cast back)."""
    freqs = (BASE ** (-2.0 * torch.arange(RD // 2, dtype=torch.float64) / RD)).float()
    ang = pos.float()[:, None] * freqs  # angles in fp32 (module doc)
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    sin = -sin if inverse else sin
    a, b = x[..., -RD::2].float(), x[..., -RD + 1::2].float()
    out = x.clone()
    out[..., -RD::2] = (a * cos - b * sin).to(x.dtype)
    out[..., -RD + 1::2] = (a * sin + b * cos).to(x.dtype)
    return out


@pytest.mark.parametrize("inverse", [False, True])
def test_matches_the_per_element_formula(inverse: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 12, generator=g)
    pos = [0, 1, 7, 30, 1000]
    got = RotaryEmbedding(RD, BASE, None).rotate(x, torch.tensor(pos), inverse)
    assert torch.equal(got[..., :-RD], x[..., :-RD])
    assert torch.allclose(got.double(), _reference(x, pos, inverse), atol=4e-5)  # observed 2.2e-5: fp32 angles at pos 1000


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inverse", [False, True])
def test_bit_for_bit_the_fp32_complex_product(dtype: torch.dtype, inverse: bool) -> None:
    """The pair-swapped form (tail * C + swap(tail) * S) rounds exactly like the complex product."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, 16, generator=g).to(dtype)
    pos = torch.randint(0, 5000, (64,), generator=g)
    rope = RotaryEmbedding(RD, BASE, None)
    want = _fp32_formula(x, pos, inverse)
    assert torch.equal(rope.rotate(x, pos, inverse), want)
    y = x.clone()
    assert rope.rotate(y, pos, inverse, inplace=True) is y and torch.equal(y, want)


def test_rank_two_input_and_whole_vector_rope() -> None:
    """x [T, d] (the kv rows), and d == rope_dim (no head dims left)."""
    g = torch.Generator().manual_seed(2)
    pos = torch.tensor([3, 9, 4])
    rope = RotaryEmbedding(RD, BASE, None)
    x = torch.randn(3, 10, generator=g)
    assert torch.equal(rope.rotate(x, pos), _fp32_formula(x[:, None], pos)[:, 0])
    v = torch.randn(3, 2, RD, generator=g)
    assert torch.equal(rope.rotate(v, pos), _fp32_formula(v, pos))


def test_autograd_path_same_values_and_gradients() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 2, 12, generator=g, requires_grad=True)
    pos = torch.tensor([0, 5, 6, 11])
    rope = RotaryEmbedding(RD, BASE, None)
    out = rope.rotate(x, pos, inplace=True)  # ignored under autograd: x is left alone
    assert out is not x and torch.equal(out.detach(), _fp32_formula(x.detach(), pos))
    out.pow(2).sum().backward()
    assert torch.allclose(x.grad, 2 * x.detach(), atol=1e-5)  # a rotation keeps |x|^2; observed 4.8e-7


def test_tables_follow_the_positions_tensor() -> None:
    """A table is reused only for the same positions tensor, unchanged."""
    rope = RotaryEmbedding(RD, BASE, None)
    x = torch.ones(2, 1, RD)
    pos = torch.tensor([1, 2])
    first = rope.rotate(x, pos)
    pos.add_(3)  # same tensor, new version: the table must be rebuilt
    assert torch.equal(rope.rotate(x, pos), _fp32_formula(x, torch.tensor([4, 5])))
    assert not torch.equal(first, rope.rotate(x, pos))
