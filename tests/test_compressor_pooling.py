"""model.compressor: each emitted entry equals the §4.5 pooling written out per channel.

Entry j of a ratio-r compressor pools, per channel c, the slots of its group (overlap: the Ca half
of the previous group's tokens, then the Cb half of its own) with softmax weights over the
slots of z + ape; slots at positions < 0 take no weight. The prompt arrives in two chunks, so
the first groups read positions before 0 and a later group straddles the chunk boundary
(ring rows of the previous step).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from kvshare.config import load_config
from kvshare.model.compressor import Compressor
from kvshare.cache.dense import DenseCache
from kvshare.step import StepBatch
from kvshare.topology import Topology

F64 = torch.float64


@torch.no_grad()
def _entry(comp: Compressor, x: torch.Tensor, j: int) -> torch.Tensor:
    """Latent of entry j from the whole prompt x [P, hidden], per channel with Python floats."""
    r, d = comp.ratio, comp.dim
    a, z = x @ comp.wkv.weight.t(), x @ comp.wgate.weight.t()
    slots = []  # (token, column offset)
    if comp.overlap:
        slots += [(t, 0) for t in range(r * (j - 1), r * j)]
        slots += [(t, d) for t in range(r * j, r * j + r)]
    else:
        slots += [(t, 0) for t in range(r * j, r * j + r)]
    pooled = torch.zeros(d, dtype=F64)
    for c in range(d):
        live = [(t, off) for t, off in slots if t >= 0]
        s = [float(z[t, off + c] + comp.ape[t % r, off + c]) for t, off in live]
        m = max(s)
        w = [math.exp(v - m) for v in s]
        pooled[c] = sum(wi * float(a[t, off + c]) for wi, (t, off) in zip(w, live)) / sum(w)
    return pooled * torch.rsqrt(pooled.pow(2).mean() + comp.norm.eps) * comp.norm.weight


@pytest.mark.parametrize("ratio,overlap", [(4, True), (8, False)])
def test_entries_match_the_pooling_formula_across_chunks(ratio: int, overlap: bool) -> None:
    cfg = load_config("tiny-v4")
    hidden, d = 16, 6
    g = torch.Generator().manual_seed(0)
    comp = Compressor(hidden, d, ratio, 1e-6, overlap=overlap, ape=True).to(F64)
    with torch.no_grad():
        for p in comp.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64))
    cache = DenseCache(cfg, Topology(cfg), 1, 64, dtype=F64)
    x = torch.randn(3 * ratio + 3, hidden, generator=g, dtype=F64)
    cut = ratio + 2  # chunk 2 starts inside group 1
    got = {}
    for lo, hi in ((0, cut), (cut, x.shape[0])):
        batch = StepBatch.build([lo], [hi - lo], [0])
        ctx = SimpleNamespace(positions=batch.positions, seq_index=batch.seq_index, batch=batch, cache=cache,
                              addr=batch.addresses())
        with torch.no_grad():
            out = comp(x[lo:hi], ctx, 0)
        got.update({int(j): out.latent[e] for e, j in enumerate(out.j)})
    assert sorted(got) == list(range(x.shape[0] // ratio))
    for j, latent in got.items():
        err = float((latent - _entry(comp, x, j)).abs().max())
        assert err < 1e-12, (j, err)  # float64: observed <= 8.9e-16
