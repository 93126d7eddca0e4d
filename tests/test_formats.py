"""Row formats: exact byte sizes (spec/cache.md §2) and bit-exact pack / unpack of fake-quantised rows."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare import quant
from kvshare.cache.formats import _ue8m0_bytes, row_format
from kvshare.errors import ConfigError

SIZES = [
    # kind, name, dim, arch, rope, row_bytes, data, scales, pad
    ("kv", "fp4", 512, "v41", 64, 288, 256, 32, 0),
    ("kv", "fp8", 512, "v41", 64, 528, 512, 16, 0),
    ("kv", "fp8", 512, "v4", 64, 584, 576, 7, 1),
    ("kv", "fp8_v4", 512, "v41", 64, 584, 576, 7, 1),
    ("kv", "fp8_v41", 512, "v4", 64, 528, 512, 16, 0),
    ("kv", "bf16", 512, "v41", 64, 1024, 1024, 0, 0),
    ("kv", "fp32", 512, "v41", 64, 2048, 2048, 0, 0),
    ("index_k", "fp4", 128, "v41", 0, 68, 64, 4, 0),
    ("index_k", "fp8", 128, "v41", 0, 132, 128, 4, 0),
    ("index_k", "bf16", 128, "v41", 0, 256, 256, 0, 0),
    ("index_k", "fp32", 128, "v41", 0, 512, 512, 0, 0),
    ("window", "fp8", 512, "v41", 64, 528, 512, 16, 0),
    ("window", "fp8", 512, "v4", 64, 584, 576, 7, 1),
    ("window", "bf16", 512, "v41", 64, 1024, 1024, 0, 0),
    ("kv", "fp64", 512, "v41", 64, 4096, 4096, 0, 0),
    ("index_k", "fp64", 128, "v41", 0, 1024, 1024, 0, 0),
    ("window", "fp64", 512, "v41", 64, 4096, 4096, 0, 0),
    # tiny models: block = min(nominal block, dim)
    ("kv", "fp4", 16, "v41", 8, 9, 8, 1, 0),
    ("kv", "fp8", 16, "v41", 8, 17, 16, 1, 0),
    ("kv", "fp8", 16, "v4", 8, 32, 24, 1, 7),
    ("index_k", "fp4", 16, "v41", 0, 9, 8, 1, 0),
    ("index_k", "fp8", 16, "v41", 0, 20, 16, 4, 0),
    ("kv", "fp4", 64, "v41", 8, 36, 32, 4, 0),
]


@pytest.mark.parametrize("kind,name,dim,arch,rope,row,data,scales,pad", SIZES)
def test_row_sizes(kind, name, dim, arch, rope, row, data, scales, pad) -> None:
    f = row_format(kind, name, dim, arch=arch, rope_dim=rope)
    assert (f.row_bytes, f.data_bytes, f.scale_bytes, f.pad_bytes) == (row, data, scales, pad)
    assert f.pack(torch.randn(3, dim)).shape == (3, row)


def _wide(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random rows whose blocks span many magnitudes (incl. e4m3-subnormal fp4 scales and zeros)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-14, 10, (*shape[:-1], 1), generator=g).float())
    x[..., : shape[-1] // 8] *= torch.exp2(torch.randint(-8, 1, (1,), generator=g).float())
    x[0, 0] = 0.0
    return x


@pytest.mark.parametrize("kind,name,dim,arch,rope", [s[:5] for s in SIZES if s[1] != "fp64"])
def test_fake_quantised_rows_round_trip_bit_exactly(kind, name, dim, arch, rope) -> None:
    f = row_format(kind, name, dim, arch=arch, rope_dim=rope)
    for seed in range(3):
        y = f.fake_quant(_wide((24, 2, dim), seed))
        torch.testing.assert_close(f.unpack(f.pack(y)), y, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["kv", "index_k", "window"])
def test_fp64_rows_keep_float64_values_exactly(kind: str) -> None:
    """A float64 model's plain rows: values fp32 cannot hold come back bit for bit."""
    f = row_format(kind, "fp64", 16)
    x = _wide((5, 16), 1).double() * (1 + 2.0 ** -40)
    assert not torch.equal(x.float().double(), x)
    assert torch.equal(f.fake_quant(x), x)
    got = f.unpack(f.pack(x))
    assert got.dtype == torch.float64 and torch.equal(got, x)


@pytest.mark.parametrize("kind,name", [("kv", "fp4"), ("kv", "fp8"), ("index_k", "fp4"), ("kv", "fp8_v4")])
def test_raw_rows_are_stored_as_their_fake_quant_and_that_is_lossy(kind, name) -> None:
    """Negative control: the exactness above is not vacuous; raw rows lose bits."""
    dim = 128
    f = row_format(kind, name, dim, rope_dim=64)
    x = torch.randn(32, dim, dtype=torch.float32)
    got = f.unpack(f.pack(x))
    torch.testing.assert_close(got, f.fake_quant(x), rtol=0, atol=0)
    assert not torch.equal(got, x)
    corrupted = f.pack(f.fake_quant(x))
    corrupted[5, 0] ^= 0x11
    assert not torch.equal(f.unpack(corrupted), f.fake_quant(x))


def test_fp4_e4m3_pack_is_exact_where_requantising_is_not() -> None:
    """Blocks with an e4m3-subnormal scale: the quantiser is not idempotent, the packer still is."""
    x = torch.randn(2048, 16) * 0.01
    y = quant.fake_quant_fp4(x, 16, "e4m3")
    assert not torch.equal(quant.fake_quant_fp4(y, 16, "e4m3"), y)  # the trap exists
    f = row_format("kv", "fp4", 16)
    torch.testing.assert_close(f.unpack(f.pack(y)), y, rtol=0, atol=0)


def test_fp4_bytes_even_element_in_low_nibble_then_e4m3_scales() -> None:
    f = row_format("kv", "fp4", 32)
    x = torch.zeros(32)
    x[0], x[1], x[2], x[16] = 1.0, 6.0, -0.5, 3.0  # block 0: amax 6 -> scale 1; block 1: amax 3 -> scale 0.5
    b = f.pack(x)
    assert b[0].item() == 0x72  # element 0 -> code 2 (1.0) low, element 1 -> code 7 (6.0) high
    assert b[1].item() == 0x09  # element 2 -> sign | code 1 (-0.5)
    assert b[8].item() == 0x07  # element 16 -> 3.0 / 0.5 = 6 -> code 7
    assert b[16].item() == torch.tensor(1.0).to(torch.float8_e4m3fn).view(torch.uint8).item()
    assert b[17].item() == torch.tensor(0.5).to(torch.float8_e4m3fn).view(torch.uint8).item()
    assert torch.equal(f.unpack(b), x)


def test_ue8m0_scale_bytes_are_biased_exponents() -> None:
    f = row_format("index_k", "fp4", 64)
    x = torch.zeros(64)
    x[0] = 6.0  # scale 1 -> 127
    x[32] = 24.0  # scale 4 -> 129
    b = f.pack(x)
    assert b[32:].tolist() == [127, 129]
    w = row_format("window", "fp8", 64)
    x = torch.zeros(64)
    x[0], x[32] = 448.0, 448.0 / 8  # scales 1 and 1/8
    assert w.pack(x)[64:].tolist() == [127, 124]


def test_fp8_v4_layout_nope_then_bf16_rope_then_scales_and_zero_pad() -> None:
    f = row_format("kv", "fp8_v4", 512, rope_dim=64)
    x = f.fake_quant(torch.randn(2, 512))
    b = f.pack(x)
    assert torch.equal(b[:, 448:576].contiguous().view(torch.bfloat16).float(), x[:, 448:])
    assert torch.equal(b[:, 583], torch.zeros(2, dtype=torch.uint8))
    q, s = quant.fp8_codes(x[:, :448], 64)
    assert torch.equal(b[:, :448], q.view(torch.uint8))
    assert torch.equal(torch.exp2(b[:, 576:583].float() - 127), s)


def test_fp8_index_row_has_one_fp32_power_of_two_scale() -> None:
    f = row_format("index_k", "fp8", 128)
    y = f.fake_quant(torch.randn(3, 128))
    s = f.pack(y)[:, 128:].contiguous().view(torch.float32)
    mant, _ = torch.frexp(s)
    assert torch.all(mant == 0.5)


def test_leading_dims_and_bf16_inputs() -> None:
    f = row_format("kv", "fp4", 512)
    y = f.fake_quant(torch.randn(2, 3, 4, 512)).to(torch.bfloat16)
    out = f.unpack(f.pack(y))
    assert out.shape == (2, 3, 4, 512) and out.dtype == torch.float32
    assert torch.equal(out, y.float())


def test_zero_width_rows() -> None:
    f = row_format("index_k", "fp4", 0)
    assert f.row_bytes == 0
    assert f.unpack(f.pack(torch.zeros(3, 0))).shape == (3, 0)


@pytest.mark.parametrize(
    "kind,name,dim,rope,field",
    [
        ("kv", "int8", 512, 64, "kv_format"),
        ("window", "fp4", 512, 64, "window_format"),
        ("index_k", "fp8_v4", 128, 0, "index_format"),
        ("kv", "fp4", 24, 8, "kv_format"),  # 24 values, block 16
        ("kv", "fp8_v4", 16, 16, "kv_format"),  # no nope dims
        ("kv", "fp8_v4", 16, 3, "kv_format"),  # odd rope
        ("kv", "fp4", -4, 0, "kv_format"),
    ],
)
def test_bad_formats_raise_config_error(kind, name, dim, rope, field) -> None:
    with pytest.raises(ConfigError) as e:
        row_format(kind, name, dim, rope_dim=rope)
    assert e.value.field == field


def test_pack_and_unpack_reject_wrong_shapes() -> None:
    f = row_format("kv", "fp4", 16)
    with pytest.raises(ValueError):
        f.pack(torch.zeros(2, 32))
    with pytest.raises(ValueError):
        f.unpack(torch.zeros(2, 10, dtype=torch.uint8))


_FORMATS = [s[:5] for s in SIZES if s[2] <= 128 and s[1] != "fp64"] + [("kv", "fp4", 256, "v41", 32), ("window", "fp8", 96, "v4", 32)]


@settings(max_examples=100, deadline=None)
@given(which=st.sampled_from(_FORMATS), rows=st.integers(1, 5), exp=st.integers(-30, 30),
       seed=st.integers(0, 2**16), sparse=st.booleans())
def test_round_trip_property(which, rows, exp, seed, sparse) -> None:
    kind, name, dim, arch, rope = which
    f = row_format(kind, name, dim, arch=arch, rope_dim=rope)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=g) * 2.0**exp
    if sparse:
        x = x * (torch.rand(rows, dim, generator=g) < 0.2)
    y = f.fake_quant(x)
    torch.testing.assert_close(f.unpack(f.pack(y)), y, rtol=0, atol=0)


@settings(max_examples=100, deadline=None)
@given(rows=st.integers(1, 4), exp=st.integers(-60, 60), seed=st.integers(0, 2**16))
def test_packed_ue8m0_scales_are_in_range_powers_of_two(rows, exp, seed) -> None:
    """`pack` stores ue8m0 scale bytes without checking them (hot path); the scales it stores come
    from the quantisers, which make them powers of two inside 2^-127 .. 2^127 (checked here with
    ``check=True``)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 128, generator=g) * 2.0**exp
    for scale in (quant.fp4_codes(x, 32, "ue8m0")[1], quant.fp8_codes(x, 64, ue8m0=True)[1],
                  quant.fp8_codes(x, 128, ue8m0=True)[1]):
        assert torch.equal(_ue8m0_bytes(scale, check=True), _ue8m0_bytes(scale))


def test_checked_ue8m0_bytes_reject_what_the_bytes_cannot_hold() -> None:
    assert _ue8m0_bytes(torch.tensor([1.0, 0.5, 2.0**127, 2.0**-126]), check=True).tolist() == [127, 126, 254, 1]
    with pytest.raises(ValueError, match="powers of two"):
        _ue8m0_bytes(torch.tensor([1.0, 3.0]), check=True)
    with pytest.raises(ValueError, match="ue8m0 range"):
        _ue8m0_bytes(torch.tensor([2.0**-140]), check=True)
