"""The AMX path's own machinery (kvshare/kernels/csrc/gemm_amx.cpp): FP8 / FP4 scales applied as an
exponent add where every scaled code stays a normal bf16 (else as an fp32 multiply), weights
decoded 16 pairs at a time in calls of at most 32 rows or per group for all of K above that, and
K walked in chunks of 128 pairs with C kept in fp32 between them."""

from __future__ import annotations

import pytest
import torch

from kernel_data import e4m3_codes, fp4_pairs, pow2_scales
from kvshare import kernels
from kvshare.quant import FP4_GRID

pytestmark = pytest.mark.skipif("amx" not in kernels.supported_isas(), reason="CPU without AMX-BF16")

ROWS = (1, 16, 17, 32, 33, 40)  # <= 32: decoded as the tile walks K; 1 and 16: half tiles; > 32: per group
BF16_MIN_NORMAL = 2.0 ** -126


def _expected(values: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
    """value * 2^(e - 127) as the AMX tile reads it: fp32 (inf past its range), then bf16 (exact:
    at most 4 significant bits), subnormal bf16 read as zero."""
    w = (values.double() * torch.exp2(exps.double() - 127)).float().to(torch.bfloat16)
    return torch.where(w.abs() < BF16_MIN_NORMAL, torch.zeros_like(w), w)


def _one_weight_per_row(values_k0: torch.Tensor, k: int) -> torch.Tensor:
    """[n, k]: row n holds its value at k = 0, zeros elsewhere (ones as activations then read it
    alone, and an inf weight meets no zero activation: no NaN from inf * 0)."""
    w = torch.zeros(values_k0.shape[0], k, dtype=values_k0.dtype)
    w[:, 0] = values_k0
    return w


def test_fp8_every_code_at_the_scale_edges() -> None:
    """Every finite e4m3 code times scales on both sides of the exponent-add range (2^-117 ..
    2^119) and past it (flushed to zero, or inf): equal to value * 2^s in float64 rounded as the
    tile reads it. Observed: exact (0 differences) at every row count."""
    exps = torch.tensor([1, 5, 9, 10, 11, 127, 245, 246, 247, 248, 254], dtype=torch.uint8)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # the NaN codes
    value = codes.view(torch.float8_e4m3fn).float()
    n = 256 * len(exps)
    gen = torch.Generator().manual_seed(21)
    row_exps = exps.repeat_interleave(256)
    cases = [((256, 32), exps.view(-1, 1), row_exps),  # one scale per 256 rows: per 16-row group
             ((1, 32), None, None)]  # a scale per row, shuffled: groups mix fast and slow lanes
    for block, scale, per_row in cases:
        if scale is None:
            per_row = row_exps[torch.randperm(n, generator=gen)]
            scale = per_row.view(-1, 1)
        w8 = _one_weight_per_row(value.repeat(len(exps)), 32).to(torch.float8_e4m3fn)
        p = kernels.pack_fp8(w8, scale.view(torch.float8_e8m0fnu), block)
        want = _expected(value.repeat(len(exps)), per_row)
        for m in ROWS:
            y = kernels.linear(torch.ones(m, 32, dtype=torch.bfloat16), p, isa="amx")
            assert torch.equal(y, want.expand(m, n)), f"block {block}, rows {m}"


def test_fp4_every_code_at_the_scale_edges() -> None:
    """Every e2m1 code times per-row scales on both sides of the exponent-add range (2^-125 ..
    2^125), each 16-row group one exponent (all lanes fast or all slow) and then shuffled
    (mixed groups). Observed: exact at every row count."""
    exps = torch.tensor([1, 2, 3, 127, 251, 252, 253, 254], dtype=torch.uint8)
    codes = torch.arange(16, dtype=torch.uint8).repeat(len(exps))
    mag = FP4_GRID[(codes & 7).long()]
    value = torch.where(codes >= 8, -mag, mag)
    pairs = torch.zeros(codes.shape[0], 16, dtype=torch.uint8)  # K = 32: code at k = 0, zeros
    pairs[:, 0] = codes
    row_exps = exps.repeat_interleave(16)
    gen = torch.Generator().manual_seed(22)
    for order in (torch.arange(codes.shape[0]), torch.randperm(codes.shape[0], generator=gen)):
        per_row = row_exps[order]
        p = kernels.pack_fp4(pairs, per_row.view(-1, 1).view(torch.float8_e8m0fnu))
        want = _expected(value, per_row)
        for m in ROWS:
            y = kernels.linear(torch.ones(m, 32, dtype=torch.bfloat16), p, isa="amx")
            assert torch.equal(y, want.expand(m, codes.shape[0])), f"rows {m}"


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp4"])
def test_k_chunks_and_row_tiles_do_not_change_bits(fmt: str) -> None:
    """K = 544 (272 pairs: chunks of 128, 128 and 16 above 32 rows, one pass below; a partial
    128-block for FP8) on raw data (inexact sums): every row of calls of 33, 64, 100 and 600 rows
    (two passes of 512) equals the row alone, which runs K in one piece."""
    gen = torch.Generator().manual_seed(23)
    n, k = 70, 544
    if fmt == "bf16":
        p = kernels.pack_bf16(torch.randn(n, k, generator=gen) * 0.05)
    elif fmt == "fp8":
        p = kernels.pack_fp8(e4m3_codes(n, k, gen), pow2_scales((1, 5), gen), (128, 128))
    else:
        p = kernels.pack_fp4(fp4_pairs(n, k, gen), pow2_scales((n, k // 32), gen))
    x = torch.randn(600, k, generator=gen).to(torch.bfloat16)
    alone = torch.cat([kernels.linear(x[i:i + 1], p, isa="amx", fp32_totals=True) for i in range(600)])
    for m in (33, 64, 100, 600):
        y = kernels.linear(x[600 - m:], p, isa="amx", fp32_totals=True)
        assert torch.equal(y, alone[600 - m:]), f"{fmt} rows {m}"


def test_bf16_output_is_the_fp32_total_rounded_to_nearest_even() -> None:
    """The tile epilogue (VCVTNE2PS2BF16 for rows of two whole 16-output groups, the integer
    rounding otherwise and for NaN, subnormal or -0 totals): every non-NaN output's bits equal
    torch's bf16 rounding of the fp32 total, and every NaN total gives the kernels' one quiet NaN
    0x7fc0 (torch keeps the payload: 0xffff for AMX's inf - inf). N = 40: two whole groups, one
    partial. Totals include NaN, +-inf and products of 2^-130. Observed: bitwise equal."""
    gen = torch.Generator().manual_seed(24)
    n, k = 40, 64
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    w[3, 5] = float("nan")
    w[20, 0], w[20, 1] = float("inf"), float("-inf")  # inf - inf: NaN
    w[7, 2] = float("inf")
    w[33, :] = 2.0 ** -60  # with the tiny rows below: products of 2^-130 (fp32 subnormal)
    w[1, :] = 2.0 ** -60
    p = kernels.pack_bf16(w)
    x = torch.randn(70, k, generator=gen).to(torch.bfloat16)
    x[4] = 2.0 ** -70
    x[40] = 2.0 ** -70
    for m in (1, 8, 33, 70):
        totals = kernels.linear(x[:m], p, isa="amx", fp32_totals=True)
        y = kernels.linear(x[:m], p, isa="amx")
        nan = totals.isnan()
        assert torch.equal(y.isnan(), nan), f"rows {m}"
        assert bool((y.view(torch.int16)[nan] == 0x7FC0).all()), f"rows {m}"
        want = totals.to(torch.bfloat16).view(torch.int16)
        assert torch.equal(y.view(torch.int16)[~nan], want[~nan]), f"rows {m}"
    assert totals.isnan().any() and totals.isinf().any()  # the specials really occur


def test_large_outputs_written_non_temporally_keep_their_bits() -> None:
    """An output of >= 2 MiB (600 x 1800 bf16: 2.16 MB) takes the non-temporal stores: every value
    equals the fp32 total rounded by torch, and rows computed alone (small outputs: ordinary
    stores) match. Observed: bitwise equal."""
    gen = torch.Generator().manual_seed(25)
    p = kernels.pack_bf16(torch.randn(1800, 256, generator=gen) * 0.05)
    x = torch.randn(600, 256, generator=gen).to(torch.bfloat16)
    y = kernels.linear(x, p, isa="amx")
    assert y.numel() * 2 >= 2 << 20
    assert torch.equal(y, kernels.linear(x, p, isa="amx", fp32_totals=True).to(torch.bfloat16))
    for i in (0, 299, 599):
        assert torch.equal(y[i:i + 1], kernels.linear(x[i:i + 1], p, isa="amx"))
