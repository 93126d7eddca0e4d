"""The compressor's [a | z] projection in one kernel call = the two products, bit for bit, and the
fused pack follows in-place weight changes; the bound layers' implementations (`CompressProject`,
`CompressPool`, kvshare.layers.compressor) against each other."""

from __future__ import annotations

import pytest
import torch

from kvshare import kernels
from kvshare.kernels import decode as native
from types import SimpleNamespace

from kvshare.layers.compressor import CompressPool
from kvshare.model.compressor import Compressor
from kvshare.ops import invariant

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")


def _compressor() -> Compressor:
    c = Compressor(96, 64, 4, 1e-6, overlap=True, ape=True)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in c.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / 10)
    return c


@pytest.mark.parametrize("rows", [1, 5, 37])
def test_fused_projection_equals_the_two_products(rows: int) -> None:
    c = _compressor()
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    az = kernels.linear_checked(x, c.project.pack())
    a, z = invariant.row_linear(x, c.wkv.weight), invariant.row_linear(x, c.wgate.weight)
    assert torch.equal(az, torch.cat([a, z], dim=-1))


def test_fused_pack_follows_in_place_weight_changes() -> None:
    """Mutation caught: a key without the weights' versions serves the stale pack here."""
    c = _compressor()
    x = torch.randn(3, 96)
    before = kernels.linear_checked(x, c.project.pack())
    with torch.no_grad():
        c.wgate.weight.mul_(2.0)
    after = kernels.linear_checked(x, c.project.pack())
    assert torch.equal(after[:, :128], before[:, :128]) and torch.equal(after[:, 128:], 2 * before[:, 128:])


@pytest.mark.parametrize("rows", [1, 5, 37])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_project_wide_is_the_widened_product_plus_the_ape_row(rows: int, dtype: torch.dtype) -> None:
    """`native.project_wide` = wide(x) through the fused kernel, then ``az[:, w:] += ape[pos % ratio]``
    (the torch code it replaces), bit for bit; and within fp32 rounding of the float64 formula.
    Mutations caught: the APE row of ``pos`` instead of ``pos % ratio`` (out of range: error here,
    wrong row for a table as long as the positions), the APE added to the [a] half (offset 0)."""
    c = _compressor()
    g = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    pos = torch.randint(0, 1000, (rows,), generator=g)
    packed = c.project.pack()
    az = native.project_wide(x, packed, c.ape.detach(), pos, 128)
    want = kernels.linear_checked(x.float(), packed)
    want[:, 128:] += c.ape.detach()[pos % 4]
    assert az.dtype == torch.float32 and torch.equal(az, want)
    w64 = torch.cat([c.wkv.weight, c.wgate.weight]).double()
    exact = x.double() @ w64.T
    exact[:, 128:] += c.ape.double()[pos % 4]
    err = (az.double() - exact).abs().max().item()
    assert err < 2e-6, err  # observed 2.4e-7 (|az| < 2.5; 96 fp32 terms)
    assert torch.equal(native.project_wide(x, packed), kernels.linear_checked(x.float(), packed))


def test_project_wide_rejects_what_it_cannot_take() -> None:
    c = _compressor()
    packed = c.project.pack()
    x = torch.randn(2, 96)
    with pytest.raises(RuntimeError, match="positions"):
        native.project_wide(x, packed, c.ape.detach(), None, 128)
    with pytest.raises(RuntimeError, match="does not fit"):
        native.project_wide(x, packed, c.ape.detach(), torch.zeros(2, dtype=torch.int64), 200)
    with pytest.raises(ValueError, match="fp32 pack"):
        native.project_wide(x.bfloat16(), kernels.pack_bf16(c.wkv.weight.detach().bfloat16()))



def _ctx(pos: torch.Tensor) -> SimpleNamespace:
    """What `CompressProject` reads of a step: the positions and their phase (position mod ratio)."""
    return SimpleNamespace(positions=pos, addr=SimpleNamespace(phase=lambda r: pos % r))


@pytest.mark.parametrize("impl", ["forward_packed", "forward_native", "forward_torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_projection_implementations_agree(impl: str, dtype: torch.dtype) -> None:
    """`CompressProject`'s implementations against its row-invariant torch products: the packed
    GEMM and the one native call bitwise (each output the fixed-order sum over K alone), the batched
    torch products (oneDNN's order) within fp32 rounding (observed 1.2e-6 on |az| < 3.3). Mutation
    caught (forward_packed and forward_native, both dtypes): the APE row of phase ``(pos + 1) % ratio``
    in `_products`."""
    c = _compressor()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(9, 96, generator=g).to(dtype)
    ctx = _ctx(torch.randint(0, 1000, (9,), generator=g))
    with torch.no_grad():
        want = c.project.forward_invariant(x, ctx)
        got = getattr(c.project, impl)(x, ctx)
    assert got.dtype == torch.float32 and got.shape == (9, 256)
    if impl == "forward_torch":
        assert (got - want).abs().max().item() < 4e-6
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ratio,dim,overlap", [(4, 64, True), (2, 128, False), (8, 64, False)])
def test_pooling_implementations_agree(ratio: int, dim: int, overlap: bool, out: torch.dtype, masked: bool) -> None:
    """`CompressPool`'s native call is its torch softmax pooling, bit for bit (d a multiple of 64);
    masked: each group's leading slots at positions < 0. Mutation caught (every masked case): the
    native call given no mask (`forward_native` passing None)."""
    coff = 2 if overlap else 1
    g = torch.Generator().manual_seed(ratio * dim)
    hist = torch.randn(5, coff * ratio, 2 * coff * dim, generator=g)
    valid = None
    if masked:
        n = coff * ratio  # every group keeps its last slot (a group is emitted at its last token)
        valid = torch.arange(n).unsqueeze(0) >= torch.tensor([0, 1, min(3, n - 1), n - 1, min(2, n - 1)]).unsqueeze(1)
    pool = CompressPool(ratio, dim, overlap)
    with torch.no_grad():
        got, want = pool.forward_native(hist, valid, out), pool.forward_torch(hist, valid, out)
    assert got.dtype == out and torch.equal(got, want)
