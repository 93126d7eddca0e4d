"""Checkpoint weight formats: block-scaled FP8 and packed FP4 (e2m1) weights, decode and encode.

Formats read here (spec/model.md §1.3, §6):

* **FP8 block-scaled** (attention projections, shared experts, ...): the weight is
  ``float8_e4m3fn`` ``[..., out, in]``; its companion scale is ``[..., ceil(out / bo), ceil(in / bi)]``
  with ``(bo, bi)`` = the config's ``quantization_config.weight_block_size``. Scales are stored as
  fp32 or as ``float8_e8m0fnu`` (ue8m0: a biased power-of-two exponent, 2^(byte - 127)). The real
  value of element (o, i) is ``float(w[o, i]) * scale[o // bo, i // bi]``; partial edge blocks are
  allowed.
* **FP4 e2m1 experts**: the weight is stored packed, two codes per byte, as ``int8`` / ``uint8`` (or
  ``float4_e2m1fn_x2``) ``[..., out, in / 2]``. Packing assumed: element ``2k`` of a row sits in the
  LOW nibble of byte k, element ``2k + 1`` in the HIGH nibble (the order of ``float4_e2m1fn_x2``).
  A code is sign bit 3 plus magnitude index bits 0-2 into {0, 0.5, 1, 1.5, 2, 3, 4, 6} (the standard
  e2m1 encoding, identical to `kvshare.quant.fp4_codes`). Scales are ue8m0 (or fp32) ``[..., out,
  in / 32]``: one per 32 consecutive input elements.

The encoders (`quantize_fp8_weight`, `pack_fp4_weight`) produce exactly these formats; they are
used by tests and by anyone writing a quantised checkpoint.
"""

from __future__ import annotations

import math

import torch

from kvshare.quant import FP8_MAX, fp4_codes, fp4_dequant, pow2_ceil

FP4_WEIGHT_BLOCK = 32

_PACKED_FP4_DTYPES = (torch.int8, torch.uint8) + (
    (torch.float4_e2m1fn_x2,) if hasattr(torch, "float4_e2m1fn_x2") else ()
)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """A stored scale as fp32: ue8m0 (``float8_e8m0fnu``) bytes become 2^(byte - 127)."""
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        exp = scale.view(torch.uint8).to(torch.int32) - 127
        return torch.exp2(exp.to(torch.float32))
    return scale.to(torch.float32)


def is_fp8(t: torch.Tensor) -> bool:
    """Whether `t` holds e4m3 codes of an FP8 block-scaled weight."""
    return t.dtype == torch.float8_e4m3fn


def is_packed_fp4(t: torch.Tensor) -> bool:
    """Whether `t` holds packed e2m1 pairs (an FP4 weight); only meaningful when a scale comes with it."""
    return t.dtype in _PACKED_FP4_DTYPES


def _expand_blocks(scale: torch.Tensor, rows: int, cols: int, bo: int, bi: int) -> torch.Tensor:
    full = scale.repeat_interleave(bo, dim=-2).repeat_interleave(bi, dim=-1)
    return full[..., :rows, :cols]


def fp8_block_scale_shape(weight_shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale shape an FP8 weight of `weight_shape` must have for `block` = (bo, bi)."""
    *lead, rows, cols = weight_shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def dequant_fp8_weight(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Decode an FP8 block-scaled weight to fp32 (see the module docstring for the layout)."""
    if weight.dim() < 2:
        raise ValueError(f"an FP8 block-scaled weight needs at least 2 dims, got shape {tuple(weight.shape)}")
    want = fp8_block_scale_shape(tuple(weight.shape), block)
    if tuple(scale.shape) != want:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not fit weight {tuple(weight.shape)} "
                         f"with block {tuple(block)} (expected {want})")
    rows, cols = weight.shape[-2:]
    s = _expand_blocks(scale_to_float(scale), rows, cols, block[0], block[1])
    return weight.to(torch.float32) * s


def quantize_fp8_weight(w: torch.Tensor, block: tuple[int, int], ue8m0: bool = True
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode `w` [..., out, in] as (e4m3 weight, scale): per (bo x bi) tile, amax / 448 rounded up to
    a power of two when `ue8m0` (then returned as ``float8_e8m0fnu``), else fp32."""
    bo, bi = block
    *lead, rows, cols = w.shape
    pr, pc = math.ceil(rows / bo) * bo, math.ceil(cols / bi) * bi
    x = torch.zeros(*lead, pr, pc, dtype=torch.float32)
    x[..., :rows, :cols] = w.float()
    tiles = x.reshape(*lead, pr // bo, bo, pc // bi, bi)
    amax = tiles.abs().amax(dim=(-3, -1)).clamp_min(1e-4)
    scale = pow2_ceil(amax / FP8_MAX) if ue8m0 else amax / FP8_MAX
    s_full = _expand_blocks(scale, rows, cols, bo, bi)
    q = (w.float() / s_full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, (scale.to(torch.float8_e8m0fnu) if ue8m0 else scale)


def unpack_fp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """Packed bytes [..., n / 2] -> e2m1 codes uint8 [..., n] (low nibble first)."""
    b = packed.contiguous().view(torch.uint8)
    lo, hi = b & 0x0F, (b >> 4) & 0x0F
    return torch.stack((lo, hi), dim=-1).reshape(*b.shape[:-1], b.shape[-1] * 2)


def pack_fp4_codes(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes uint8 [..., n] (n even) -> packed int8 [..., n / 2] (low nibble first)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even last dim, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def dequant_fp4_weight(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Decode a packed FP4 weight [..., out, in / 2] with its per-block scale [..., out, in / blk] to fp32.

    The block is read from the shapes (``in / scale.shape[-1]``; 32 in released checkpoints)."""
    codes = unpack_fp4_codes(packed)
    n = codes.shape[-1]
    if tuple(scale.shape[:-1]) != tuple(codes.shape[:-1]) or scale.shape[-1] == 0 or n % scale.shape[-1]:
        raise ValueError(f"FP4 scale shape {tuple(scale.shape)} does not fit packed weight "
                         f"{tuple(packed.shape)} (unpacked input dim {n})")
    block = n // scale.shape[-1]
    return fp4_dequant(codes, scale_to_float(scale), block)


def pack_fp4_weight(w: torch.Tensor, block: int = FP4_WEIGHT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode `w` [..., out, in] as (packed int8 [..., out, in / 2], ue8m0 scale [..., out, in / block])."""
    codes, scale = fp4_codes(w, block, "ue8m0")
    return pack_fp4_codes(codes), scale.to(torch.float8_e8m0fnu)


def release_quantize(state: dict[str, torch.Tensor], names: set[str] | frozenset[str],
                     block: tuple[int, int] = (128, 128)) -> dict[str, torch.Tensor]:
    """`state` with the weights in `names` stored as the release stores them: routed experts
    (``.experts.`` in the name) as packed FP4 with ue8m0 scales per 32 inputs, the others as FP8
    e4m3 with ue8m0 `block` scales; each gets its ``<module>.scale`` companion. Other tensors are
    kept as they are. (For tests and the quantised bench model.)"""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name not in names:
            out[name] = t
            continue
        stem = name[: -len(".weight")] if name.endswith(".weight") else name
        if ".experts." in name and t.shape[-1] % FP4_WEIGHT_BLOCK == 0:
            out[name], out[stem + ".scale"] = pack_fp4_weight(t.float())
        else:
            out[name], out[stem + ".scale"] = quantize_fp8_weight(t.float(), block)
    return out
