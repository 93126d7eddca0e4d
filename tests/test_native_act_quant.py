"""The native FP8 activation rounding (kernels.decode.fake_quant_fp8) gives kvshare.quant's bits.

`model/quantize.act_quant` rounds every FP8 GEMM input to e4m3 with ue8m0 block scales; the torch
code does it in ~40 torch ops per call, the kernel in one loop (c10's e4m3 / bf16 conversions, frexp
for the power-of-two scale). Compared bitwise with `kvshare.quant.fake_quant_fp8` (torch ops) on
rows whose magnitudes span 2^-40 .. 2^12 (e4m3 subnormals, the 1e-4 amax floor, saturation at
448 * scale), all-zero rows, bf16 and fp32, 1..33 rows, blocks 32 / 64 / 128, a strided input.
Mutations caught: the amax floor ``max(amax, 1e-4)`` dropped (the tiny and zero rows), and the scale
taken one power of two up where amax / 448 is itself a power of two (the m == 0.5 case). (The clamp
to +-448 cannot change a value: x / scale is exact and scale >= amax / 448; it is kept as torch has it.)
"""

from __future__ import annotations

import pytest
import torch

from kvshare.kernels import decode as native
from kvshare.model.quantize import act_quant
from kvshare.quant import fake_quant_fp8

pytestmark = pytest.mark.skipif(not native.enabled(), reason="native kernels not built here")


def _rows(n: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=g) * torch.pow(2.0, torch.randint(-40, 13, (n, 1), generator=g).float())
    x[0, :] = 0.0  # amax below the floor
    if n > 2:
        x[1, ::32] = 448.0 * 2.0 ** -3 * torch.sign(x[1, ::32])  # blocks whose amax / 448 is a power of two
        x[1] = torch.where(x[1].abs() > 56.0, x[1].clamp(-56.0, 56.0), x[1])
        x[2, :] = torch.arange(width).float() * 1e-7  # every value tiny: the floor sets the scale
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block", [32, 64, 128])
@pytest.mark.parametrize("n", [1, 2, 7, 33])
def test_native_fake_quant_fp8_is_quants_bits(dtype: torch.dtype, block: int, n: int) -> None:
    x = _rows(n, 4 * block, dtype, seed=n * block)
    got = native.fake_quant_fp8(x, block)
    want = fake_quant_fp8(x, block, ue8m0=True)
    assert got is not None and got.dtype == want.dtype
    assert torch.equal(got, want)


def test_strided_input_and_act_quant_route() -> None:
    x = _rows(6, 512, torch.bfloat16, seed=3)[:, ::2]  # a non-contiguous view, 256 wide
    assert torch.equal(native.fake_quant_fp8(x, 128), fake_quant_fp8(x, 128, ue8m0=True))
    assert torch.equal(act_quant(x, 128, native=True), fake_quant_fp8(x, 128, ue8m0=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width,block", [(256, 128), (96, 32), (48, 32)])  # 48: the block fitted to 16
def test_act_quant_native_is_the_torch_rounding(dtype: torch.dtype, width: int, block: int, monkeypatch) -> None:
    """`layers.quant.act_quant` with ``native`` (what a `QLinear` bound to a native choice passes)
    = the torch rounding, bitwise, and the kernel ran. Mutation caught (run): `fp8_round` handing the
    kernel ``block * 2``."""
    from kvshare.layers import KernelChoice
    from kvshare.layers.linear import QLinear
    from kvshare.model.quantize import QuantMode

    g = torch.Generator().manual_seed(width)
    steps = torch.pow(2.0, torch.randint(-6, 7, (1, width // 16), generator=g).float()).repeat_interleave(16, 1)
    x = (_rows(9, width, torch.float32, seed=width) * steps).to(dtype)  # scales that change along a row
    calls = []
    real = native.fake_quant_fp8
    monkeypatch.setattr(native, "fake_quant_fp8", lambda *a: calls.append(1) or real(*a))
    assert torch.equal(act_quant(x, block, native=True), act_quant(x, block))
    assert calls
    lin = QLinear(width, 8, QuantMode.of(True), block).to(dtype).requires_grad_(False)
    want = lin(x)  # built bound to the reference: the torch rounding
    lin.bind(KernelChoice(gemm=True, native=True))
    n = len(calls)
    assert torch.equal(lin(x), want) and len(calls) == n + 1


def test_autograd_inputs_keep_the_torch_path() -> None:
    x = torch.randn(2, 128, requires_grad=True)
    assert native.fake_quant_fp8(x, 128) is None  # the straight-through estimator needs torch ops
    act_quant(x, 128, native=True).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
