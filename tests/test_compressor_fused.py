"""The compressor's [a | z] projection in one kernel call = the two products, bit for bit, and the
fused pack follows in-place weight changes."""

from __future__ import annotations

import pytest
import torch

from kvshare import kernels
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
