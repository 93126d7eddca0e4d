"""The reduction-order contract of kvshare.kernels: a row's output bits do not depend on how many
rows the call has, where the row sits, what the other rows are, or the thread count."""

from __future__ import annotations

import pytest
import torch

from kernel_data import e4m3_codes, fp4_pairs, pow2_scales
from kvshare import kernels

ISAS = kernels.supported_isas()
ROW_COUNTS = (1, 2, 7, 8, 16, 20, 32, 33, 300)  # 300: a prefill-sized call (more than one 64-row super tile);
# 16 / 20: AMX computes one 16-row tile for calls of at most 16 rows, both for 17-32 rows; 32 / 33:
# AMX decodes FP8 / FP4 as the tile walks K up to 32 rows, per group (and walks K in chunks) above


def _packs(gen: torch.Generator) -> list[kernels.Packed]:
    """Odd N (partial 16-output groups); K = 231 (partial chunks and scale blocks: the AVX-512
    path under "amx") and K = 224 (whole 32-input tiles, a partial 128-block: served by AMX)."""
    n = 45
    out = []
    for k in (231, 224):
        w = torch.randn(n, k, generator=gen) * 0.05
        out += [kernels.pack_bf16(w), kernels.pack_fp8(e4m3_codes(n, k, gen), pow2_scales((1, 2), gen), (128, 128))]
    w = torch.randn(n, 231, generator=gen) * 0.05
    return out + [kernels.pack_fp32(w), kernels.pack_fp4(fp4_pairs(n, 224, gen), pow2_scales((n, 7), gen))]


@pytest.mark.parametrize("isa", ISAS)
def test_row_count_and_position_do_not_change_bits(isa: str) -> None:
    gen = torch.Generator().manual_seed(7)
    for p in _packs(gen):
        pool = torch.randn(400, p.k, generator=gen).to(p.act_dtype)  # raw data: sums are inexact
        single = torch.cat([kernels.linear(pool[i:i + 1], p, isa=isa) for i in range(300)])
        for m in ROW_COUNTS:
            for start in (0, 300 - m):  # the rows at different positions, with different neighbours
                y = kernels.linear(pool[start:start + m], p, isa=isa)
                assert torch.equal(y, single[start:start + m]), f"{p.fmt} {isa} rows={m} start={start}"
        # the same row surrounded by other rows than in any call above
        mixed = torch.cat([pool[350:357], pool[5:6], pool[360:385]])
        assert torch.equal(kernels.linear(mixed, p, isa=isa)[7], single[5]), p.fmt


@pytest.mark.parametrize("isa", [i for i in ISAS if i != "torch"])
def test_thread_count_does_not_change_bits(isa: str) -> None:
    gen = torch.Generator().manual_seed(8)
    before = torch.get_num_threads()
    try:
        for p in _packs(gen):
            x = torch.randn(33, p.k, generator=gen).to(p.act_dtype)
            torch.set_num_threads(1)
            one = kernels.linear(x, p, isa=isa)
            torch.set_num_threads(2)
            assert torch.equal(kernels.linear(x, p, isa=isa), one), p.fmt
    finally:
        torch.set_num_threads(before)


def test_leading_dims_and_empty_calls() -> None:
    gen = torch.Generator().manual_seed(9)
    p = _packs(gen)[0]
    x = torch.randn(3, 5, p.k, generator=gen).to(torch.bfloat16)
    y = kernels.linear(x, p)
    assert y.shape == (3, 5, p.n)
    assert torch.equal(y[1, 2], kernels.linear(x[1, 2:3], p)[0])
    assert kernels.linear(x[:0], p).shape == (0, 5, p.n)
