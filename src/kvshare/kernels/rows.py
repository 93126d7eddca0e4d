"""Native cache-row codecs and FP4 quantise-dequantise (csrc/rows.cpp), the same bits as the torch code.

`cache/formats.py` (``RowFormat.pack`` / ``unpack``) and `model/quantize.py` (the KV quantiser's
FP4 rounding) call these for bf16 / fp32 CPU tensors without autograd; ``kvshare.quant`` and the
formats' torch code stay the reference (tests compare every scheme bit for bit) and the fallback
(float64 rows, other devices, ``KVSHARE_NATIVE_DECODE=off``, no native library). A row of the fp4 /
fp8 schemes costs one call here instead of 20-60 torch ops.
"""

from __future__ import annotations

import torch

from kvshare.kernels import decode as native
from kvshare.kernels.ops import ops

#: RowFormat schemes served here -> the kernel's scheme id (csrc/rows.h)
SCHEMES = {"fp4_e4m3": 0, "fp4_ue8m0": 1, "fp8_v41": 2, "fp8_v4": 3}
_FLOATS = (torch.float32, torch.bfloat16)


def serves(x: torch.Tensor) -> bool:
    """Whether the native codecs take `x` (bf16 / fp32 or uint8 rows on the CPU, no autograd)."""
    if not native.enabled() or x.device.type != "cpu":
        return False
    return x.dtype == torch.uint8 or (x.dtype in _FLOATS and not (x.requires_grad and torch.is_grad_enabled()))


def fake_quant_fp4(x: torch.Tensor, block: int, scale_fmt: str) -> torch.Tensor:
    """`quant.fake_quant_fp4(x, block, scale_fmt)` in one call (caller checked `serves(x)`)."""
    return ops.fake_quant_fp4(x, block, scale_fmt == "ue8m0")


def pack(scheme: str, x: torch.Tensor, block: int, rope_dim: int, row_bytes: int) -> torch.Tensor:
    """`RowFormat.pack` of the scheme's rows (caller checked `serves(x)` and the scheme)."""
    return ops.pack_rows(x, SCHEMES[scheme], block, rope_dim, row_bytes)


def unpack(scheme: str, u8: torch.Tensor, block: int, dim: int, rope_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """`RowFormat.unpack(u8, dtype)` for bf16 / fp32 `dtype` (caller checked `serves(u8)`)."""
    return ops.unpack_rows(u8, SCHEMES[scheme], block, dim, rope_dim, dtype)


def ring_store(rings: list[torch.Tensor], values: list[torch.Tensor], tokens: torch.Tensor, slot: torch.Tensor,
               row: torch.Tensor) -> None:
    """``rings[i][slot[j], row[j]] = bytes of values[i][tokens[j]]`` for every ring and kept row, in one
    call (`Ring.write` of plain encodings; the caller checked `Ring.stores_bytes_of` and `serves`)."""
    ops.ring_store(rings, values, tokens, slot, row)
