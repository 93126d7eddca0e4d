"""Weights repacked once into the kernels' layouts (`Packed`), and back (`dequantize`).

Layouts (NB = ceil(N / 16) groups of 16 outputs, zero-padded; see csrc/gemm.h):

* ``bf16``: int32 [NB, KP / 2, 16], a bf16 pair (k = 2p low half, 2p + 1 high) per output and pair;
  KP = K rounded up to even, padded with zeros.
* ``fp32``: float32 [NB, K, 16].
* ``fp8``: uint8 [NB, KP / 2, 16, 2] e4m3 codes; ``exps`` uint8 [NB, ceil(K / bk)]: the ue8m0 exponent
  (scale 2^(e - 127)) of each 16-row group and K block of `bk` when the checkpoint's row block is a
  multiple of 16 (128 x 128 in the release: the checkpoint's scale bytes, repeated 8 times), else
  [NB, ceil(K / bk), 16], one per row.
* ``fp4``: uint8 [NB, KP / 2, 16] e2m1 pairs as stored (low nibble = even k); ``exps`` as for fp8 with
  bk = 32 (the checkpoint's own scale bytes): 4.25 bits per weight, exactly the checkpoint's.

Scales must be powers of two (ue8m0, or fp32 holding one): the kernel multiplies each block sum
by its scale exactly. A non-power-of-two scale raises ValueError (callers dequantise instead).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvshare.quant import FP4_GRID

GROUP = 16   # outputs per vector group
MAX_BLOCK = 256  # largest scale block along K (csrc MAX_BLOCK)
FORMAT_ID = {"bf16": 0, "fp32": 1, "fp8": 2, "fp4": 3}


@dataclass(eq=False)
class Packed:
    """A weight W [n, k] in a kernel layout (module doc). `block`: scale block along K (0: none)."""

    fmt: str
    n: int
    k: int
    kp: int
    block: int
    data: torch.Tensor
    exps: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        """[n, k]: the shape of the weight it stands for (so shape checks treat it like a tensor)."""
        return torch.Size((self.n, self.k))

    @property
    def nbytes(self) -> int:
        """Bytes held in memory (weights plus scale exponents)."""
        return self.data.numel() * self.data.element_size() + self.exps.numel()

    @property
    def act_dtype(self) -> torch.dtype:
        """The activation (and output) dtype the kernel takes: fp32 for fp32 weights, else bf16."""
        return torch.float32 if self.fmt == "fp32" else torch.bfloat16


def _groups(n: int) -> int:
    return -(-n // GROUP)


def _pad2(t: torch.Tensor, rows: int, cols: int, value: float | int = 0, copy: bool = True) -> torch.Tensor:
    if not copy and tuple(t.shape) == (rows, cols) and t.is_contiguous():
        return t  # nothing to pad (the caller copies into its layout anyway)
    out = torch.full((rows, cols), value, dtype=t.dtype)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def _lanes(t: torch.Tensor) -> torch.Tensor:
    """A new contiguous [G, C, 16] copy of t [G, 16, C] (rows to lanes). ``copy_`` into a fresh tensor:
    never a view of `t`, and 2x faster than ``permute().contiguous()`` for the byte layouts."""
    out = torch.empty((t.shape[0], t.shape[2], t.shape[1]), dtype=t.dtype)
    return out.copy_(t.permute(0, 2, 1))


def _no_exps() -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _check_2d(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [out, in], got shape {tuple(t.shape)}")


def pack_bf16(w: torch.Tensor) -> Packed:
    """Pack a weight [N, K] (any float dtype; rounded to bf16) for bf16 activations."""
    _check_2d("weight", w)
    n, k = w.shape
    nb, kp = _groups(n), k + k % 2
    wp = _pad2(w.detach().to("cpu", torch.bfloat16), nb * GROUP, kp).view(torch.int16)
    data = wp.reshape(nb, GROUP, kp // 2, 2).permute(0, 2, 1, 3).contiguous().view(torch.int32)
    return Packed("bf16", n, k, kp, 0, data.reshape(nb, kp // 2, GROUP), _no_exps())


def pack_fp32(w: torch.Tensor) -> Packed:
    """Pack an fp32 weight [N, K] for fp32 activations (the model's fp32 set)."""
    _check_2d("weight", w)
    n, k = w.shape
    nb = _groups(n)
    wp = _pad2(w.detach().to("cpu", torch.float32), nb * GROUP, k)
    return Packed("fp32", n, k, k, 0, wp.reshape(nb, GROUP, k).permute(0, 2, 1).contiguous(), _no_exps())


def scale_exponents(scale: torch.Tensor, what: str) -> torch.Tensor:
    """Biased exponents (uint8, 2^(e - 127)) of power-of-two scales stored as ue8m0 or as floats."""
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        return scale.view(torch.uint8).clone()
    s = scale.detach().to("cpu", torch.float32)
    m, e = torch.frexp(s)
    biased = e.to(torch.int32) - 1 + 127  # s = 0.5 * 2^e = 2^(e - 1)
    ok = (m == 0.5) & (biased >= 0) & (biased <= 254)
    if not bool(ok.all()):
        bad = s[~ok][0].item()
        raise ValueError(f"{what} scales must be powers of two in [2^-127, 2^127] to stay packed (found {bad})")
    return biased.to(torch.uint8)


def _lane_exps(exps_rows: torch.Tensor, n: int, nb: int, kb: int) -> torch.Tensor:
    """Per-output exponents [n, kb] -> [NB, kb, 16] (padding rows: 127, scale 1)."""
    full = _pad2(exps_rows[:n, :kb], nb * GROUP, kb, 127, copy=False)
    return _lanes(full.reshape(nb, GROUP, kb))


def _check_block(block: int, what: str) -> None:
    if block < 2 or block % 2 or block > MAX_BLOCK:
        raise ValueError(f"{what} scale block along K must be even and in [2, {MAX_BLOCK}], got {block}")


def pack_fp8(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> Packed:
    """Pack an e4m3 weight [N, K] with its block scale [ceil(N/bo), ceil(K/bi)], block = (bo, bi)."""
    _check_2d("FP8 weight", codes)
    if codes.dtype != torch.float8_e4m3fn:
        raise ValueError(f"FP8 weight must be float8_e4m3fn, got {codes.dtype}")
    n, k = codes.shape
    bo, bi = block
    _check_block(bi, "FP8")
    want = (math.ceil(n / bo), math.ceil(k / bi))
    if tuple(scale.shape) != want:
        raise ValueError(f"FP8 scale shape {tuple(scale.shape)} does not fit weight {(n, k)} with block "
                         f"{tuple(block)} (expected {want})")
    nb, kb = _groups(n), want[1]
    kp = k + k % 2
    e = scale_exponents(scale, "FP8")
    if bo % GROUP == 0:  # each 16-row group lies inside one row block
        exps = e[torch.arange(nb) * GROUP // bo].contiguous()
    else:
        exps = _lane_exps(e.repeat_interleave(bo, dim=0), n, nb, kb)
    c = _pad2(codes.detach().to("cpu").view(torch.uint8), nb * GROUP, kp, copy=False)
    # (k, k + 1) byte pairs move together: as int16 lanes (the same bytes as permute(0, 2, 1, 3))
    pairs = _lanes(c.view(torch.int16).reshape(nb, GROUP, kp // 2))
    data = pairs.view(torch.uint8).reshape(nb, kp // 2, GROUP, 2)
    return Packed("fp8", n, k, kp, bi, data, exps)


def pack_fp4(packed: torch.Tensor, scale: torch.Tensor) -> Packed:
    """Pack an FP4 weight as the checkpoint stores it: pairs [N, K/2] (int8 / uint8 /
    float4_e2m1fn_x2, low nibble = even k) and scales [N, K/block] (ue8m0 or power-of-two floats)."""
    _check_2d("FP4 weight", packed)
    n, half = packed.shape
    k = 2 * half
    if scale.dim() != 2 or scale.shape[0] != n or scale.shape[1] == 0 or k % scale.shape[1]:
        raise ValueError(f"FP4 scale shape {tuple(scale.shape)} does not fit packed weight {(n, half)}")
    block = k // scale.shape[1]
    _check_block(block, "FP4")
    nb, kb = _groups(n), scale.shape[1]
    exps = _lane_exps(scale_exponents(scale, "FP4"), n, nb, kb)
    b = _pad2(packed.detach().to("cpu").view(torch.uint8), nb * GROUP, k // 2, copy=False)
    data = _lanes(b.reshape(nb, GROUP, k // 2))
    return Packed("fp4", n, k, k, block, data, exps)


def row_exponents(p: Packed) -> torch.Tensor:
    """Unbiased scale exponents [n, ceil(k / block)] (int32) of an FP8 / FP4 `Packed`, per output row."""
    if p.exps.dim() == 2:  # one per 16-row group
        e = p.exps.repeat_interleave(GROUP, dim=0)
    else:
        e = p.exps.permute(0, 2, 1).reshape(-1, p.exps.shape[1])
    return e[: p.n].to(torch.int32) - 127


def _exp_rows(p: Packed) -> torch.Tensor:
    """Per-output scale [n, K] as fp32, expanded from the exponents."""
    return torch.exp2(row_exponents(p).float()).repeat_interleave(p.block, dim=1)[:, : p.k]


def dequantize(p: Packed) -> torch.Tensor:
    """The weight [n, k] the packed form stands for: fp32 for ``fp32``, otherwise bf16 (exact: a code
    times a power of two has at most 4 significant bits)."""
    if p.fmt == "fp32":
        return p.data.permute(0, 2, 1).reshape(-1, p.k)[: p.n].clone()
    if p.fmt == "bf16":
        w = p.data.view(torch.int16).reshape(p.data.shape[0], p.kp // 2, GROUP, 2).permute(0, 2, 1, 3)
        return w.reshape(-1, p.kp).view(torch.bfloat16)[: p.n, : p.k].clone()
    if p.fmt == "fp8":
        c = p.data.permute(0, 2, 1, 3).reshape(-1, p.kp)[: p.n, : p.k]
        vals = c.contiguous().view(torch.float8_e4m3fn).float()
    else:
        b = p.data.permute(0, 2, 1).reshape(-1, p.k // 2)[: p.n].long()
        codes = torch.stack([b & 15, b >> 4], dim=-1).reshape(p.n, p.k)
        mag = FP4_GRID[codes & 7]
        vals = torch.where(codes >= 8, -mag, mag)
    return (vals * _exp_rows(p)).to(torch.bfloat16)
