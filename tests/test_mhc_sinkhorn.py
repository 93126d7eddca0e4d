"""mHC Sinkhorn (spec/model.md §7.1 step 3) on the numpy fast path for few-token steps.

`hc_mix` sends inference steps of <= NUMPY_SINKHORN_MAX_T tokens through numpy; the result must
be bitwise what the spec's divisions give when written out here with torch (fp32 and float64),
and the full `hc_mix` must agree on both sides of the token threshold.
"""

from __future__ import annotations

import pytest
import torch

from kvshare.layers import mhc_torch as mhc


def _spec_sinkhorn(comb: torch.Tensor, eps: float, iters: int) -> torch.Tensor:
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("t", [1, 8, mhc.NUMPY_SINKHORN_MAX_T, mhc.NUMPY_SINKHORN_MAX_T + 1])
def test_hc_mix_comb_is_bitwise_the_spec_sinkhorn(dtype: torch.dtype, t: int) -> None:
    g = torch.Generator().manual_seed(t)
    hc, d, eps, iters = 4, 16, 1e-6, 20
    h = torch.randn(t, hc, d, generator=g, dtype=dtype)
    fn = torch.randn((2 + hc) * hc, hc * d, generator=g, dtype=dtype) * 0.1
    base = torch.randn((2 + hc) * hc, generator=g, dtype=dtype)
    scale = torch.rand(3, generator=g, dtype=dtype) + 0.5
    with torch.inference_mode():
        pre, post, comb = mhc.hc_mix(h, fn, base, scale, rms_eps=1e-6, hc_eps=eps, iters=iters)
        m = mhc.rms_normalize(h.reshape(t, -1), 1e-6) @ fn.t()
        start = torch.softmax((m[:, 2 * hc:] * scale[2] + base[2 * hc:]).view(t, hc, hc), dim=-1) + eps
        want = _spec_sinkhorn(start, eps, iters)
    assert comb.dtype == want.dtype
    assert torch.equal(comb, want)
