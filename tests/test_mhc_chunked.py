"""Chunked inference mHC (`model/mhc_chunked.py`) against the spec's formulas (spec/model.md §7.1).

The oracle is written out here per token with explicit loops over streams: mix statistics,
pre/post/comb, Sinkhorn, collapse and expand. Chunk sizes are forced small so every pass runs
several chunks and a ragged last one. A second check pins the chunked passes to
`model/mhc.py`'s whole-step functions bitwise where the ops are the same.
"""

from __future__ import annotations

import pytest
import torch

from kvshare.layers import mhc_chunked
from kvshare.layers import mhc_torch as mhc
from kvshare.layers.mhc_chunked import HcMix, HcWeights, hc_boundary, hc_enter

HC, D, ITERS, RMS_EPS, HC_EPS = 4, 24, 20, 1e-6, 1e-6


def _weights(g: torch.Generator, dtype: torch.dtype) -> HcWeights:
    n = (2 + HC) * HC
    fn = torch.randn(n, HC * D, generator=g, dtype=torch.float64) / (HC * D) ** 0.5
    base = 0.5 * torch.randn(n, generator=g, dtype=torch.float64)
    scale = 1 + 0.1 * torch.randn(3, generator=g, dtype=torch.float64)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return HcWeights(fn.to(acc), base.to(acc), scale.to(acc), RMS_EPS, HC_EPS, ITERS)


def _spec_mix(h: torch.Tensor, w: HcWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 1-3 of §7.1 token by token in float64."""
    fn, b, s = w.fn.double(), w.base.double(), w.scale.double()
    pres, posts, combs = [], [], []
    for row in h.double():
        flat = row.reshape(-1)
        m = fn @ (flat / torch.sqrt((flat * flat).sum() / flat.numel() + RMS_EPS))
        pres.append(torch.sigmoid(m[:HC] * s[0] + b[:HC]) + HC_EPS)
        posts.append(2 * torch.sigmoid(m[HC:2 * HC] * s[1] + b[HC:2 * HC]))
        c = torch.softmax((m[2 * HC:] * s[2] + b[2 * HC:]).view(HC, HC), dim=-1) + HC_EPS
        c = c / (c.sum(0, keepdim=True) + HC_EPS)
        for _ in range(ITERS - 1):
            c = c / (c.sum(1, keepdim=True) + HC_EPS)
            c = c / (c.sum(0, keepdim=True) + HC_EPS)
        combs.append(c)
    return torch.stack(pres), torch.stack(posts), torch.stack(combs)


def _spec_collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return sum(pre[:, j:j + 1] * h[:, j].double() for j in range(HC))


def _spec_expand(h: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    out = torch.empty(h.shape, dtype=torch.float64)
    for k in range(HC):
        out[:, k] = post[:, k:k + 1] * y.double() + sum(comb[:, j, k:k + 1] * h[:, j].double() for j in range(HC))
    return out


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mhc_chunked, "CHUNK_BYTES", 5 * 4 * HC * D)  # about 5 rows per chunk


@pytest.mark.parametrize("lagged", [False, True])
@pytest.mark.parametrize("t", [1, 5, 13])
def test_enter_and_boundary_follow_the_spec_float64(lagged: bool, t: int) -> None:
    g = torch.Generator().manual_seed(t + 10 * lagged)
    h = torch.randn(t, HC, D, generator=g, dtype=torch.float64)
    y = torch.randn(t, D, generator=g, dtype=torch.float64)
    wa, wf = _weights(g, torch.float64), _weights(g, torch.float64)
    prev = torch.rand(t, HC, generator=g, dtype=torch.float64) if lagged else None
    with torch.no_grad():
        x, mix = hc_enter(h, wa, prev)
        h2, x2, mix2 = hc_boundary(h, y, mix, wf, mix.pre if lagged else None)
    pre, post, comb = _spec_mix(h, wa)
    assert torch.allclose(mix.pre, pre, rtol=0, atol=2e-15)  # observed <= 4.5e-16 (pre, post, comb)
    assert torch.allclose(mix.post, post, rtol=0, atol=2e-15)
    assert torch.allclose(mix.comb, comb, rtol=0, atol=2e-15)
    assert torch.allclose(x, _spec_collapse(h, prev if lagged else pre), rtol=0, atol=5e-15)  # observed <= 1.8e-15 (x, streams)
    want_h2 = _spec_expand(h, y, post, comb)
    assert torch.allclose(h2, want_h2, rtol=0, atol=5e-15)
    pre2, post2, comb2 = _spec_mix(want_h2, wf)
    assert torch.allclose(mix2.pre, pre2, rtol=0, atol=2e-15) and torch.allclose(mix2.comb, comb2, rtol=0, atol=2e-15)
    assert torch.allclose(x2, _spec_collapse(want_h2, pre if lagged else pre2), rtol=0, atol=5e-15)
    h3, none_x, none_mix = hc_boundary(h2, y, mix2, None)
    assert none_x is None and none_mix is None
    assert torch.allclose(h3, _spec_expand(want_h2, y, post2, comb2), rtol=0, atol=5e-15)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t", [3, 17])
def test_chunked_passes_match_the_whole_step_functions(dtype: torch.dtype, t: int) -> None:
    """Collapse and expand (row-wise ops) are bitwise `model/mhc.py`'s for the same mixes; the mixes
    themselves agree to fp32 rounding (the mixes' GEMM may pick another kernel for a chunk's row
    count, and torch's vectorised sigmoid can round 1 ulp differently by position in a vector)."""
    g = torch.Generator().manual_seed(t)
    torch.set_num_threads(1)
    h = torch.randn(t, HC, D, generator=g).to(dtype)
    y = torch.randn(t, D, generator=g).to(dtype)
    wa = _weights(g, dtype)
    prev = torch.rand(t, HC, generator=g)
    kw = dict(rms_eps=RMS_EPS, hc_eps=HC_EPS, iters=ITERS)
    with torch.no_grad():
        pre, post, comb = mhc.hc_mix(h, wa.fn, wa.base, wa.scale, **kw)
        x, mix = hc_enter(h, wa, prev)
        h2, _, _ = hc_boundary(h, y, HcMix(pre, post, comb), None)
    assert torch.equal(x, mhc.hc_collapse(h, prev))
    assert torch.equal(h2, mhc.hc_expand(h, y, post, comb)) and h2.dtype == dtype
    for got, want in ((mix.pre, pre), (mix.post, post), (mix.comb, comb)):
        assert torch.allclose(got, want, rtol=0, atol=5e-7)  # observed <= 1.8e-7


def test_boundary_without_next_sublayer_keeps_dtype_and_shape() -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(7, HC, D, generator=g).bfloat16()
    y = torch.randn(7, D, generator=g).bfloat16()
    mix = HcMix(torch.rand(7, HC, generator=g), torch.rand(7, HC, generator=g), torch.rand(7, HC, HC, generator=g))
    with torch.no_grad():
        out, x, nxt = hc_boundary(h, y, mix, None)
    assert out.shape == h.shape and out.dtype == torch.bfloat16 and x is None and nxt is None
    assert torch.equal(out, mhc.hc_expand(h, y, mix.post, mix.comb))


@pytest.mark.parametrize("t,rows", [(1, 1), (5, 5), (6, 3), (13, 5), (16, 4), (2048, 5)])
def test_chunks_are_even_and_at_most_the_byte_budget(t: int, rows: int) -> None:
    assert mhc_chunked.chunk_rows(t, HC, D) == rows  # ceil(t / ceil(t / 5)) rows per chunk
