"""The FP8 / FP4 quantisers against hand-computed values (spec/model.md §6)."""

import torch

from kvshare.quant import (
    fake_quant_fp4,
    fake_quant_fp8,
    fp4_codes,
    fp4_dequant,
    fp8_codes,
    straight_through,
)


def test_fp4_rounds_half_to_even_on_the_e2m1_grid() -> None:
    # amax 6 -> ue8m0 scale 1, so values are rounded directly onto the grid.
    x = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, 6.0, -6.0, 0.1, 0.3, 2.9, 4.4, -5.5]])
    want = torch.tensor([[0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, -1.0, 6.0, -6.0, 0.0, 0.5, 3.0, 4.0, -6.0]])
    assert torch.equal(fake_quant_fp4(x, 16, "ue8m0"), want)


def test_fp4_ue8m0_scale_is_the_power_of_two_above_amax_over_6() -> None:
    x = torch.zeros(1, 32)
    x[0, 0] = 13.0  # 13 / 6 = 2.17 -> scale 4
    _, s = fp4_codes(x, 32, "ue8m0")
    assert s.item() == 4.0
    assert fake_quant_fp4(x, 32)[0, 0].item() == 12.0  # 13 / 4 = 3.25 -> 3


def test_fp4_e4m3_scale_and_idempotence() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=g) * 3
    y = fake_quant_fp4(x, 16, "e4m3")
    assert torch.equal(fake_quant_fp4(y, 16, "e4m3"), y)  # quantising twice changes nothing
    codes, s = fp4_codes(y, 16, "e4m3")
    assert torch.equal(fp4_dequant(codes, s, 16), y)
    assert not torch.equal(y, x)  # negative control: the quantiser does change raw values


def test_fp8_scale_is_power_of_two_and_error_bounded() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 128, generator=g)
    q, s = fp8_codes(x, 32, ue8m0=True)
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    y = fake_quant_fp8(x, 32)
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 for normal values.
    big = x.abs() > 1e-2
    assert ((y - x).abs()[big] / x.abs()[big]).max() <= 2.0**-4 + 1e-6
    assert torch.equal(fake_quant_fp8(y, 32), y)


def test_fp8_tiny_blocks_use_the_amax_floor() -> None:
    x = torch.full((1, 32), 1e-6)
    _, s = fp8_codes(x, 32)
    assert s.item() == 2.0 ** torch.ceil(torch.log2(torch.tensor(1e-4 / 448))).item()


def test_straight_through_gradient_is_identity() -> None:
    x = torch.randn(2, 32, requires_grad=True)
    y = straight_through(lambda t: fake_quant_fp4(t, 32), x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    assert torch.equal(y.detach(), fake_quant_fp4(x.detach(), 32))


def _pow2_ceil_exact(x: float) -> float:
    """Smallest power of two >= x, by exact rational comparisons (no floating log)."""
    from fractions import Fraction

    q = Fraction(x)
    k = q.numerator.bit_length() - q.denominator.bit_length()
    while Fraction(2) ** k < q:
        k += 1
    while Fraction(2) ** (k - 1) >= q:
        k -= 1
    return float(Fraction(2) ** k)


def test_pow2_ceil_is_exact_on_every_fp32_binade_edge() -> None:
    """For every fp32 exponent (subnormals included): 2^e, its neighbours, and mid-binade values.

    The old fp32 ``exp2(ceil(log2(x)))`` failed here: log2(2^-7 * (1 + 2^-23)) rounds to -7.
    """
    from kvshare.quant import pow2_ceil

    vals = []
    for e in range(-149, 127):
        p = torch.tensor(2.0**e, dtype=torch.float32)
        vals += [p, torch.nextafter(p, torch.tensor(float("inf"))), torch.nextafter(p, torch.tensor(0.0)),
                 p * 1.5, p * 1.75]
    x = torch.stack(vals)
    x = x[(x > 0) & torch.isfinite(x)]
    g = torch.Generator().manual_seed(0)
    rand = torch.exp2(torch.empty(2000).uniform_(-140, 120, generator=g)).float()
    x = torch.cat([x, rand, torch.tensor([2**-7 * (1 + 2**-23), 1e-4 / 448, 6 * 2.0**-126 / 6])])
    got = pow2_ceil(x)
    want = torch.tensor([_pow2_ceil_exact(v) for v in x.tolist()], dtype=torch.float64)
    assert torch.equal(got.double(), want)
    assert pow2_ceil(torch.tensor([2**-7 * (1 + 2**-23)])).item() == 2**-6
