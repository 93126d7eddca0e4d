"""`layers.norm.RMSNorm`: the native implementation bound for a batch-invariant native choice gives
the torch reference's bits (rows >= 8, bf16 / fp32 inputs, fp32 weight), and the binding follows
the choice. Mutation caught (run): `forward_native` passing ``self.eps * 2`` to the kernel."""

from __future__ import annotations

import pytest
import torch

from kvshare import kernels
from kvshare.layers import KernelChoice
from kvshare.layers.norm import RMSNorm, rms_normalize, rms_normalize_as

NATIVE = KernelChoice(batch_invariant=True, gemm=True, native=True)
pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 8), (5, 64), (3, 4, 100), (17, 512)])
def test_native_rmsnorm_has_the_reference_bits(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    d = shape[-1]
    norm = RMSNorm(d, 1e-6).requires_grad_(False)
    norm.weight.copy_(1 + 0.1 * torch.randn(d, generator=g))
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    norm.bind(NATIVE)
    assert norm.impl == norm.forward_native
    with torch.no_grad():
        got = norm(x)
        assert torch.equal(got, norm.forward_torch(x))
        for fn in (rms_normalize, rms_normalize_as):
            assert torch.equal(fn(x, 0.5, native=True), fn(x, 0.5))


def test_binding_follows_the_choice_and_the_weight() -> None:
    norm = RMSNorm(16, 1e-6)
    assert norm.impl == norm.forward_torch  # built: the reference
    norm.bind(NATIVE)
    assert norm.impl == norm.forward_native
    norm.bind(KernelChoice(gemm=True, native=True))  # batched mode: the reference (nothing to gain)
    assert norm.impl == norm.forward_torch
    short = RMSNorm(4, 1e-6)  # torch's scalar loop for rows < 8: the kernel would change bits
    short.bind(NATIVE)
    assert short.impl == short.forward_torch
    wide64 = RMSNorm(16, 1e-6).double()
    wide64.bind(NATIVE)
    assert wide64.impl == wide64.forward_torch


def test_native_falls_back_inside_for_inputs_it_does_not_take() -> None:
    norm = RMSNorm(16, 1e-6).requires_grad_(False)
    norm.bind(NATIVE)
    x = torch.randn(4, 32)[:, ::2]  # not contiguous
    assert torch.equal(norm(x), norm.forward_torch(x))
    short = torch.randn(3, 4)  # rows < 8: torch's own loop
    assert torch.equal(rms_normalize_as(short, 0.5, native=True), rms_normalize_as(short, 0.5))
