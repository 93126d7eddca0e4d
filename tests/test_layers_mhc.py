"""`layers.mhc.Mhc`: every implementation it binds gives its reference's bits, through one block's
enter / boundary / leave and the model's head (V4: own pre and head mixes; V4.1: lagged pre).

| implementation | reference |
|---|---|
| `NativeMhc` (unfused native calls) | `TorchMhc(invariant=True)` |
| `FusedMhc` (one native call per boundary) | `TorchMhc(invariant=True)` |
| `ChunkedMhc` (token chunks; forced with a tiny chunk) | `TorchMhc()` |

bf16 and fp32 streams, 1 and 37 rows. Mutation caught (run): `FusedMhc.boundary` collapsing with
the mix's own pre in V4.1 (``collapse_pre`` dropped). The bind selection follows the choice.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvshare import kernels
from kvshare.layers import KernelChoice
from kvshare.layers import mhc_chunked
from kvshare.layers.mhc import ChunkedMhc, FusedMhc, HcWeights, Mhc, NativeMhc, TorchMhc
from kvshare.layers.norm import RMSNorm

HC, D, ITERS, EPS = 4, 64, 20, 1e-6
NATIVE = KernelChoice(batch_invariant=True, gemm=True, native=True, fused_mhc=True)


def _weights(g: torch.Generator, n_mix: int) -> HcWeights:
    k = HC * D
    return HcWeights(torch.randn(n_mix, k, generator=g) / math.sqrt(k), 0.5 * torch.randn(n_mix, generator=g),
                     1.0 + 0.1 * torch.randn(3 if n_mix > HC else 1, generator=g), EPS, EPS, ITERS)


def _norm(g: torch.Generator, choice: KernelChoice) -> RMSNorm:
    n = RMSNorm(D, 1e-5).requires_grad_(False)
    n.weight.copy_(1 + 0.1 * torch.randn(D, generator=g))
    n.bind(choice)
    return n


def _block(impl: TorchMhc, norm_choice: KernelChoice, t: int, dtype: torch.dtype, lagged: bool):
    """enter(attn) -> boundary(ffn) -> leave -> head on fixed inputs; every output of the walk."""
    g = torch.Generator().manual_seed(t + 7 * lagged)
    h = (torch.randn(t, HC, D, generator=g) * 2).to(dtype)
    y1, y2 = torch.randn(t, D, generator=g).to(dtype), torch.randn(t, D, generator=g).to(dtype)
    prev = torch.rand(t, HC, generator=g) + 0.1
    wa, wf, wh = _weights(g, (2 + HC) * HC), _weights(g, (2 + HC) * HC), _weights(g, HC)
    na, nf, nh = _norm(g, norm_choice), _norm(g, norm_choice), _norm(g, norm_choice)
    with torch.no_grad():
        x1, m1 = impl.enter(h, wa, na, prev if lagged else None)
        h2, x2, m2 = impl.boundary(h, y1 + x1, m1, wf, nf, m1.pre if lagged else None)
        h3 = impl.leave(h2, y2 + x2, m2)
        out = impl.head(h3, m2.pre if lagged else None, nh, None if lagged else wh, EPS, EPS)
    return [x1, m1.pre, m1.post, m1.comb, h2, x2, m2.pre, m2.post, m2.comb, h3, out]


CASES = {
    "native": (NativeMhc, True),
    "fused": (FusedMhc, True),
    "chunked": (ChunkedMhc, False),
}


@pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")
@pytest.mark.parametrize("lagged", [False, True], ids=["v4", "v41"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t", [1, 37])
@pytest.mark.parametrize("name", list(CASES))
def test_each_implementation_has_its_reference_bits(name: str, t: int, dtype: torch.dtype, lagged: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    cls, invariant = CASES[name]
    if name == "chunked":  # chunk even these small steps, in pieces of 8 rows
        monkeypatch.setattr(mhc_chunked, "MIN_CHUNKS", 0)
        monkeypatch.setattr(mhc_chunked, "CHUNK_BYTES", 8 * HC * D * 4)
    norm_choice = NATIVE if invariant else KernelChoice()
    got = _block(cls(), norm_choice, t, dtype, lagged)
    want = _block(TorchMhc(invariant=invariant), KernelChoice(batch_invariant=invariant), t, dtype, lagged)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and torch.equal(a, b), (i, (a.double() - b.double()).abs().max())


def test_the_layer_binds_from_the_choice() -> None:
    m = Mhc(lagged=True, hidden=D, rms_eps=EPS, hc_eps=EPS)
    assert type(m.impl) is ChunkedMhc  # built: the reference choice (chunked only for big steps)
    m.bind(NATIVE)
    assert type(m.impl) is FusedMhc
    m.bind(NATIVE.with_(fused_mhc=False))
    assert type(m.impl) is NativeMhc
    m.bind(KernelChoice(batch_invariant=True))
    assert type(m.impl) is TorchMhc and m.impl.invariant
    small = Mhc(lagged=False, hidden=4, rms_eps=EPS, hc_eps=EPS)  # the fused norm needs rows of >= 8
    small.bind(NATIVE)
    assert type(small.impl) is NativeMhc
