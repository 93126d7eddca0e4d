"""The compressor's [a | z] projection in one kernel call = the two products, bit for bit, and the
fused pack follows in-place weight changes."""

from __future__ import annotations

import pytest
import torch

from kvshare import kernels
from kvshare.kernels import decode as native
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
    with invariant.active(True):
        az = kernels.linear_checked(x, c._fused_pack())
        a, z = invariant.row_linear(x, c.wkv.weight), invariant.row_linear(x, c.wgate.weight)
    assert torch.equal(az, torch.cat([a, z], dim=-1))


def test_fused_pack_follows_in_place_weight_changes() -> None:
    """Mutation caught: a key without the weights' versions serves the stale pack here."""
    c = _compressor()
    x = torch.randn(3, 96)
    before = kernels.linear_checked(x, c._fused_pack())
    with torch.no_grad():
        c.wgate.weight.mul_(2.0)
    after = kernels.linear_checked(x, c._fused_pack())
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
    packed = c._fused_pack()
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
    packed = c._fused_pack()
    x = torch.randn(2, 96)
    with pytest.raises(RuntimeError, match="positions"):
        native.project_wide(x, packed, c.ape.detach(), None, 128)
    with pytest.raises(RuntimeError, match="does not fit"):
        native.project_wide(x, packed, c.ape.detach(), torch.zeros(2, dtype=torch.int64), 200)
    with pytest.raises(ValueError, match="fp32 pack"):
        native.project_wide(x.bfloat16(), kernels.pack_bf16(c.wkv.weight.detach().bfloat16()))

