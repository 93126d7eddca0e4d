"""Native cache-row codecs and FP4 rounding (kernels/rows.py) = the torch reference, bit for bit.

The oracle is `kvshare.quant` / `cache/formats.py`'s torch code, itself tested against hand-written
encodings and published byte counts (tests/test_formats*.py). Inputs cover every scheme the kernels
serve, bf16 and fp32, random blocks, all-zero blocks, values on the FP4 midpoints (ties to even),
blocks whose e4m3 scale is subnormal (the exact-encoding search of `_exact_fp4_e4m3`), and every
byte value on the unpack side.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from kvshare import quant
from kvshare.cache import formats
from kvshare.kernels import rows

pytestmark = pytest.mark.skipif(not rows.native.enabled(), reason="native kernels unavailable")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32) if t.dtype == torch.float32 else t


def _inputs(dim: int, dtype: torch.dtype, block: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(dim + block)
    x = torch.randn(40, dim, generator=g) * torch.logspace(-12, 3, 40).unsqueeze(1)  # tiny to large blocks
    x[0] = 0.0
    grid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 3.0])  # FP4 midpoints: ties to even
    x[1] = grid.repeat(dim // grid.numel() + 1)[:dim] * torch.where(torch.arange(dim) % 3 == 0, -1.0, 1.0)
    x[3, :block] = 2.0**-130  # fp32 subnormals
    trap = quant.fake_quant_fp4(torch.randn(256, dim, generator=g) * 0.01, 16, "e4m3")  # e4m3-subnormal
    return torch.cat([x, trap]).to(dtype)  # scales: re-quantising changes these blocks, exact encodings exist


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block,fmt", [(16, "e4m3"), (32, "ue8m0"), (8, "e4m3")])
def test_fake_quant_fp4_has_the_torch_bits(dtype: torch.dtype, block: int, fmt: str) -> None:
    x = _inputs(64, dtype, block)
    assert torch.equal(_bits(rows.fake_quant_fp4(x, block, fmt)), _bits(quant.fake_quant_fp4(x, block, fmt)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,name,dim,rope", [("kv", "fp4", 64, 0), ("kv", "fp4", 512, 0), ("index_k", "fp4", 64, 0),
                                                ("window", "fp8_v41", 96, 0), ("kv", "fp8_v4", 192, 64),
                                                ("window", "fp8_v4", 80, 16)])
def test_row_pack_and_unpack_have_the_torch_bytes_and_bits(dtype: torch.dtype, kind: str, name: str, dim: int,
                                                           rope: int) -> None:
    arch = "v4" if name == "fp8_v4" else "v41"
    fmt = formats.row_format(kind, name, dim, arch=arch, rope_dim=rope)
    assert fmt.scheme in rows.SCHEMES
    x = _inputs(dim, dtype, fmt.block)
    if fmt.scheme == "fp4_e4m3":  # the quantiser is not idempotent on the trap rows: `pack` searches
        assert not torch.equal(fmt.fake_quant(x[40:].float()), x[40:].float())
    got = rows.pack(fmt.scheme, x, fmt.block, fmt.rope_dim, fmt.row_bytes)
    want = _torch_pack(fmt, x)
    assert torch.equal(got, want)
    for out in (torch.float32, torch.bfloat16):
        assert torch.equal(_bits(rows.unpack(fmt.scheme, got, fmt.block, dim, fmt.rope_dim, out)),
                           _bits(_torch_unpack(fmt, got, out)))


def test_unpack_decodes_every_byte_as_torch_does() -> None:
    """Every data byte under every scale byte (fp8: 256 x 256 e4m3 codes; fp4: 16 codes x 256 scales)."""
    for name, kind in (("fp8_v41", "window"), ("fp4", "kv"), ("fp4", "index_k")):
        fmt = formats.row_format(kind, name, 32, arch="v41")
        n_scales = fmt.scale_bytes
        data = torch.arange(256, dtype=torch.uint8).repeat(256 * fmt.data_bytes // 256 + 1)[: 256 * fmt.data_bytes]
        u8 = torch.cat([data.view(256, fmt.data_bytes),
                        torch.arange(256, dtype=torch.uint8).unsqueeze(1).expand(256, n_scales)], dim=1)
        got = rows.unpack(fmt.scheme, u8, fmt.block, 32, 0, torch.float32)
        want = _torch_unpack(fmt, u8, torch.float32)
        same = (got == want) | (got.isnan() & want.isnan())
        assert bool(same.all()) and torch.equal(got.isnan(), want.isnan())


def test_formats_use_the_native_codec_with_the_same_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """`RowFormat.pack` / `unpack` route bf16 / fp32 rows through the kernels (a broken kernel shows)."""
    fmt = formats.row_format("kv", "fp4", 64, arch="v41")
    x = _inputs(64, torch.float32, fmt.block)
    want = _torch_pack(fmt, x)
    assert torch.equal(fmt.pack(x), want)
    calls = []
    monkeypatch.setattr(rows, "pack", lambda *a: calls.append("pack") or want)
    monkeypatch.setattr(rows, "unpack", lambda *a: calls.append("unpack") or torch.zeros(296, 64))
    fmt.pack(x)
    fmt.unpack(want, torch.float32)
    assert calls == ["pack", "unpack"]


@contextmanager
def _torch_path() -> Iterator[None]:
    """The torch reference code of formats (the native codecs declined: `rows.serves` answers False)."""
    real = rows.serves
    rows.serves = lambda x: False
    try:
        yield
    finally:
        rows.serves = real


def _torch_pack(fmt: formats.RowFormat, x: torch.Tensor) -> torch.Tensor:
    with _torch_path():
        return fmt.pack(x)


def _torch_unpack(fmt: formats.RowFormat, u8: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    with _torch_path():
        return fmt.unpack(u8, dtype)
