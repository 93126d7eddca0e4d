"""Kernels against independent references: dequantise-then-F.linear where the arithmetic is exact,
a float64 emulation of the documented reduction order on raw data, and the code paths against
each other (kvshare/kernels)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernel_data import (e4m3_codes, emulate, exact_bf16_weight, fp4_pairs, fp8_valued, pow2_scales)
from kvshare import kernels
from kvshare.weights.weights_quant import dequant_fp4_weight, dequant_fp8_weight

ISAS = kernels.supported_isas()
ORDERED = [i for i in ISAS if i in ("avx512", "avx2")]  # the paths that follow the documented order
# the AVX-512 path with its AVX-512 BW weight decoders, which CPUs with VBMI skip (the same bits)
ORDERED += ["avx512-bw"] if "avx512" in ISAS else []
NATIVE = [i for i in ISAS if i != "torch"]
N_ODD, K_ODD = 37, 199  # neither a multiple of the 16-output groups nor of the 32-input chunks
K_TILES = 224  # 7 AMX tiles of 32 inputs (AMX serves only such weights; K_ODD goes to AVX-512)


def _case(fmt: str, gen: torch.Generator, n: int = N_ODD, k: int = K_ODD):  # noqa: C901
    """(packed weight, its value as an independent fp32 dequantisation)."""
    if fmt == "bf16":
        w = exact_bf16_weight(n, k, gen)
        return kernels.pack_bf16(w), w.float()
    if fmt.startswith("fp8"):
        block = (16, 64) if fmt == "fp8" else (8, 32)  # one scale per 16-row group / per row
        codes = e4m3_codes(n, k, gen)
        scale = pow2_scales((-(-n // block[0]), -(-k // block[1])), gen)
        return kernels.pack_fp8(codes, scale, block), dequant_fp8_weight(codes, scale, block)
    if fmt == "fp4":
        k = 160 if k % 32 else k  # FP4 K is a multiple of its 32-block: 5 (odd) or 7 blocks
        pairs, scale = fp4_pairs(n, k, gen), pow2_scales((n, k // 32), gen)
        return kernels.pack_fp4(pairs, scale), dequant_fp4_weight(pairs, scale)
    w = (torch.randint(-255, 256, (n, k + 2), generator=gen).float() / 256)
    return kernels.pack_fp32(w), w


@pytest.mark.parametrize("k", [K_ODD, K_TILES])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8-rows", "fp4", "fp32"])
def test_exact_data_equals_dequantise_then_linear(fmt: str, isa: str, k: int) -> None:
    """Every product is a multiple of 2^-13 or coarser and every |partial sum| < 2^11 (bounds of
    kernel_data), so any summation order is exact: the kernel must equal F.linear bit for bit
    at every row count 1..64."""
    gen = torch.Generator().manual_seed(11)
    p, w = _case(fmt, gen, k=k)
    if fmt == "fp32":
        x = torch.randint(-15, 16, (64, p.k), generator=gen).float() / 8
        ref = F.linear(x, w)
    else:
        x = fp8_valued(64, p.k, gen)
        ref = F.linear(x, w.to(torch.bfloat16))
        exact = (x.double() @ w.double().t()).to(torch.bfloat16)
        assert torch.equal(ref, exact)  # the data really is exact
    for m in range(1, 65):
        y = kernels.linear(x[:m], p, isa=isa)
        assert y.dtype == x.dtype and y.shape == (m, p.n)
        assert torch.equal(y, ref[:m]), f"{fmt} {isa} rows={m}"


@pytest.mark.parametrize("isa", ORDERED)
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp4"])
def test_raw_data_follows_the_documented_order(fmt: str, isa: str) -> None:
    """On raw (inexact) bf16 activations the native result is bitwise the float64 emulation of
    the documented order (odd k before even k, fp32 rounding per add, per-block scaling), both
    the fp32 totals (sensitive: a changed order shows in most outputs) and the bf16 output."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(N_ODD, 256, generator=gen) * 0.05
    if fmt == "bf16":
        p = kernels.pack_bf16(w[:, :K_ODD])
    elif fmt == "fp8":
        p = kernels.pack_fp8(e4m3_codes(N_ODD, K_ODD, gen), pow2_scales((3, 2), gen), (16, 128))
    else:
        p = kernels.pack_fp4(fp4_pairs(N_ODD, 256, gen), pow2_scales((N_ODD, 8), gen))
    x = torch.randn(9, p.k, generator=gen).to(torch.bfloat16)
    want = emulate(x, p)
    assert torch.equal(kernels.linear(x, p, isa=isa, fp32_totals=True), want)
    assert torch.equal(kernels.linear(x, p, isa=isa), want.to(torch.bfloat16))


def _normal_e4m3_codes(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random e4m3 codes with a nonzero exponent field (no zero, no subnormal, no NaN)."""
    pool = torch.tensor([c for c in range(256) if c & 0x78 and c & 0x7F != 0x7F], dtype=torch.uint8)
    return pool[torch.randint(0, len(pool), (n, k), generator=gen)].view(torch.float8_e4m3fn)


@pytest.mark.parametrize("isa", ORDERED)
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8-normal", "fp4"])
def test_few_rows_follow_the_documented_order(fmt: str, isa: str) -> None:
    """Decode steps (1-4 rows) decode the weights in registers, many output groups at a time, instead
    of through the decode-once buffer: bitwise the float64 emulation of the documented order too, at
    every row count, with full and partial group tiles (19 groups), an odd pair at the end of a
    scale block (K 201) and FP8 codes that all take the two-pair decoder's fast route (no exponent-0
    code) as well as mixed ones."""
    gen = torch.Generator().manual_seed(8)
    n, k = 293, 201
    if fmt == "bf16":
        p = kernels.pack_bf16(torch.randn(n, k, generator=gen) * 0.05)
    elif fmt.startswith("fp8"):
        codes = e4m3_codes(n, k, gen) if fmt == "fp8" else _normal_e4m3_codes(n, k, gen)
        p = kernels.pack_fp8(codes, pow2_scales((3, 2), gen), (128, 128))
    else:
        p = kernels.pack_fp4(fp4_pairs(n, 256, gen), pow2_scales((n, 8), gen))
    x = torch.randn(5, p.k, generator=gen).to(torch.bfloat16)
    for m in range(1, 6):
        want = emulate(x[:m], p)
        assert torch.equal(kernels.linear(x[:m], p, isa=isa, fp32_totals=True), want), f"rows={m}"
        assert torch.equal(kernels.linear(x[:m], p, isa=isa), want.to(torch.bfloat16)), f"rows={m}"


def test_emulation_catches_a_swapped_pair_order() -> None:
    """The emulation is sharp: the same data summed even-k-first differs in some outputs."""
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(64, 256, generator=gen) * 0.05).to(torch.bfloat16)
    x = torch.randn(16, 256, generator=gen).to(torch.bfloat16)
    swapped = torch.stack([w[:, 1::2], w[:, 0::2]], dim=-1).reshape(64, 256)
    xs = torch.stack([x[:, 1::2], x[:, 0::2]], dim=-1).reshape(16, 256)
    a = emulate(x, kernels.pack_bf16(w))
    b = emulate(xs, kernels.pack_bf16(swapped))
    assert not torch.equal(a, b)


@pytest.mark.parametrize("isa", ISAS)
def test_raw_bf16_difference_to_onednn(isa: str) -> None:
    """Raw bf16 activations and weights at the bench model's shape: the kernel differs from
    F.linear (oneDNN, its own order) by at most one bf16 ulp of the output, in few outputs
    (observed, 768 x 768, 64 rows: max 1 ulp in 0.024% of outputs (avx512), 0.008% (torch);
    at 4096 x 4096: max 3 ulps (outputs near cancellation) in 0.04%)."""
    gen = torch.Generator().manual_seed(2)
    w = (torch.randn(768, 768, generator=gen) * 0.03).to(torch.bfloat16)
    x = torch.randn(64, 768, generator=gen).to(torch.bfloat16)
    y = kernels.linear(x, kernels.pack_bf16(w), isa=isa).float()
    ref = F.linear(x, w).float()
    ulp = torch.exp2((torch.frexp(ref)[1] - 8).float())  # one bf16 ulp at the reference's magnitude
    diff = (y - ref).abs()
    assert bool((diff <= ulp).all())
    assert (diff > 0).float().mean().item() < 0.001


def test_native_paths_agree_on_raw_data() -> None:
    """AVX-512 BF16 and AVX2 give the same bits on normal-range data, every format (outputs and
    the fp32 totals before rounding)."""
    if len(NATIVE) < 2:
        pytest.skip("needs both native paths")
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(53, 320, generator=gen) * 0.05
    cases = [(kernels.pack_bf16(w), torch.bfloat16), (kernels.pack_fp32(w), torch.float32),
             (kernels.pack_fp8(e4m3_codes(53, 320, gen), pow2_scales((1, 3), gen), (128, 128)), torch.bfloat16),
             (kernels.pack_fp4(fp4_pairs(53, 320, gen), pow2_scales((53, 10), gen)), torch.bfloat16)]
    for p, dt in cases:
        x = torch.randn(19, 320, generator=gen).to(dt)
        assert torch.equal(kernels.linear(x, p, isa="avx512"), kernels.linear(x, p, isa="avx2")), p.fmt
        totals = [kernels.linear(x, p, isa=i, fp32_totals=True) for i in ("avx512", "avx2")]
        assert torch.equal(*totals), p.fmt


@pytest.mark.parametrize("isa", ISAS + (["avx512-bw"] if "avx512" in ISAS else []))
def test_every_code_decodes_to_its_value(isa: str) -> None:
    """One-hot activations read single weights: every e4m3 code (subnormals included, NaNs
    excluded) and every e2m1 code comes out as torch's / the spec's value times its scale,
    including the smallest ue8m0 scale 2^-127 (exponent byte 0) and per-row and per-group scales.
    The torch and AMX paths get no scale below 2^-100: they multiply the dequantised (scaled) bf16
    weight, and oneDNN's bf16 GEMM and AMX read subnormal bf16 weights as zero (the AVX-512 and
    AVX2 paths scale in fp32)."""
    floor = 27 if isa in ("torch", "amx") else 0
    eye = torch.eye(256, dtype=torch.bfloat16)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes[codes == 0x7F] = 0
    codes[codes == 0xFF] = 0
    fp8 = codes.view(torch.float8_e4m3fn).expand(32, 256).contiguous()
    for block, exps in (((16, 128), [[127, 120], [130, 127]]), ((8, 128), [[127, 0], [130, 127], [1, 2], [127, 127]])):
        scale = torch.tensor(exps, dtype=torch.uint8).clamp_min(floor).view(torch.float8_e8m0fnu)
        packed = kernels.pack_fp8(fp8, scale, block)
        want = dequant_fp8_weight(fp8, scale, block).t().to(torch.bfloat16)
        assert torch.equal(kernels.linear(eye, packed, isa=isa), want), block
        for m in (1, 3):  # decode-step row counts (weights decoded in registers), every code at m = 1
            for j in range(0, 256, m):
                assert torch.equal(kernels.linear(eye[j:j + m], packed, isa=isa), want[j:j + m]), (block, m, j)
    pairs = (torch.arange(256, dtype=torch.int32) % 256).to(torch.uint8).view(torch.int8)
    w4 = pairs.reshape(1, 256).expand(16, 256).contiguous()  # every (even, odd) code pair once per row
    s4 = torch.tensor([[0, 127, 1, 250, 127, 126, 127, 131] * 2] * 16, dtype=torch.uint8).clamp_min(floor)
    s4 = s4.view(torch.float8_e8m0fnu)
    eye4, p4 = torch.eye(512, dtype=torch.bfloat16), kernels.pack_fp4(w4, s4)
    want4 = dequant_fp4_weight(w4, s4).t().to(torch.bfloat16)
    assert torch.equal(kernels.linear(eye4, p4, isa=isa), want4)
    for j in range(512):  # one row at a time: the decode step's path
        assert torch.equal(kernels.linear(eye4[j:j + 1], p4, isa=isa), want4[j:j + 1]), j
