"""Packing into the kernels' layouts: values kept, bytes as the checkpoint's, clear errors, and the
torch fallback when the native library cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch

from kernel_data import e4m3_codes, fp4_pairs, pow2_scales
from kvshare import kernels
from kvshare.kernels import build
from kvshare.weights.weights_quant import dequant_fp4_weight, dequant_fp8_weight, pack_fp4_weight, quantize_fp8_weight


def test_dequantize_inverts_every_packing() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(37, 83, generator=gen)
    assert torch.equal(kernels.dequantize(kernels.pack_bf16(w)), w.to(torch.bfloat16))
    assert torch.equal(kernels.dequantize(kernels.pack_fp32(w)), w)
    codes, scale = e4m3_codes(37, 83, gen), pow2_scales((3, 2), gen)
    assert torch.equal(kernels.dequantize(kernels.pack_fp8(codes, scale, (16, 64))).float(),
                       dequant_fp8_weight(codes, scale, (16, 64)))
    pairs, s4 = fp4_pairs(37, 96, gen), pow2_scales((37, 3), gen)
    assert torch.equal(kernels.dequantize(kernels.pack_fp4(pairs, s4)).float(), dequant_fp4_weight(pairs, s4))


def test_fp32_power_of_two_scales_pack_like_ue8m0() -> None:
    w = torch.randn(64, 256)
    q, s = quantize_fp8_weight(w, (128, 128))
    a = kernels.pack_fp8(q, s, (128, 128))
    b = kernels.pack_fp8(q, s.float(), (128, 128))
    assert torch.equal(a.exps, b.exps) and torch.equal(a.data, b.data)


def test_packed_bytes_equal_the_checkpoint_bytes() -> None:
    """FP4: exactly the checkpoint's codes + scale bytes (N a multiple of 16); FP8 with 128x128
    blocks: codes + one exponent byte per row and 128 inputs (+0.78%, within 2%)."""
    w = torch.randn(256, 512)
    pairs, scale = pack_fp4_weight(w)
    assert kernels.pack_fp4(pairs, scale).nbytes == pairs.numel() + scale.numel()
    q, s = quantize_fp8_weight(w, (128, 128))
    ck = q.numel() + s.numel()
    assert abs(kernels.pack_fp8(q, s, (128, 128)).nbytes / ck - 1) < 0.02
    assert kernels.pack_bf16(w).nbytes == w.numel() * 2


def test_bad_inputs_name_the_problem() -> None:
    w = torch.randn(32, 128)
    q, s = quantize_fp8_weight(w, (128, 128), ue8m0=False)
    with pytest.raises(ValueError, match="powers of two"):
        kernels.pack_fp8(q, s * 1.5, (128, 128))
    with pytest.raises(ValueError, match="scale shape"):
        kernels.pack_fp8(q, s, (16, 128))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        kernels.pack_fp8(w, s, (128, 128))
    with pytest.raises(ValueError, match="block"):
        kernels.pack_fp8(q, torch.ones(1, 1), (128, 512))
    with pytest.raises(ValueError, match="2-D"):
        kernels.pack_bf16(w[0])
    p = kernels.pack_bf16(w)
    with pytest.raises(ValueError, match="dtype"):
        kernels.linear(torch.randn(2, 128), p)
    with pytest.raises(ValueError, match="inputs"):
        kernels.linear(torch.randn(2, 127).bfloat16(), p)


def test_build_failure_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    import torch.utils.cpp_extension as ext

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(ext, "load", no_compiler)
    monkeypatch.setattr(build, "_load_built", lambda *a: None)  # nothing built before, either
    build.library.cache_clear()
    build.best_isa.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="kvshare.kernels.build"):
            assert kernels.isa() == "torch" and not kernels.available()
            p = kernels.pack_bf16(torch.randn(20, 40))
            x = torch.randn(3, 40).bfloat16()
            y = kernels.linear(x, p)
            kernels.linear(x, p)
        w = kernels.dequantize(p)  # the fallback ran: one F.linear per row
        assert torch.equal(y, torch.cat([torch.nn.functional.linear(x[i:i + 1], w) for i in range(3)]))
        assert sum("pure-torch" in r.getMessage() for r in caplog.records) == 1
    finally:
        build.library.cache_clear()
        build.best_isa.cache_clear()


def test_aten_cpu_capability_selects_the_avx2_path(monkeypatch: pytest.MonkeyPatch) -> None:
    if "avx2" not in kernels.supported_isas():
        pytest.skip("no native AVX2 path here")
    build.best_isa.cache_clear()
    try:
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
        assert kernels.isa() == "avx2"
        build.best_isa.cache_clear()
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
        assert kernels.isa() == "torch"
    finally:
        build.best_isa.cache_clear()


def test_a_stale_build_lock_is_cleared_and_a_fresh_one_kept(tmp_path) -> None:
    """A build killed mid-way leaves torch's `lock` file, and every later load waited for it for ever."""
    import os
    import time

    lock = tmp_path / "lock"
    lock.touch()
    build._clear_stale_lock(tmp_path)
    assert lock.exists()  # a build may be running right now
    old = time.time() - build.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    build._clear_stale_lock(tmp_path)
    assert not lock.exists()
    assert build._load_built(tmp_path, "kvshare_kernels_nothing") is None  # nothing built there
