"""Per-token row formats of the paged cache: exact byte sizes and lossless pack / unpack.

A `RowFormat` describes one stored row of `dim` values (a compressed-KV latent, an index key or a
sliding-window row) as `row_bytes` uint8 bytes. Layout of a row, **interleaved per row** (kvshare's
own writer and reader agree on it; FlashMLA's block-split "all data rows, then all scale rows" page
layout of spec/cache.md §2.2 is *not* used): ``[data bytes][scale bytes][pad bytes]``.

| kind / name            | data                                   | scales                        | bytes (d=512 / 128) |
|------------------------|----------------------------------------|-------------------------------|---------------------|
| kv `fp4`               | e2m1, two per byte, even elem low nibble| e4m3, one per 16              | 288                 |
| kv, window `fp8_v41`   | e4m3, all dims                         | ue8m0, one per 32             | 528                 |
| kv, window `fp8_v4`    | e4m3 nope dims, then bf16 rope dims     | ue8m0, one per 64 nope dims, row padded to 8 B | 584 |
| index_k `fp4`          | e2m1 packed                            | ue8m0, one per 32             | 68                  |
| index_k `fp8`          | e4m3                                   | one fp32 (a power of two)     | 132                 |
| any `bf16` / `fp32` / `fp64` | plain little-endian values       | none                          | 2·d / 4·d / 8·d     |

`fp8` for kv / window resolves by architecture: V4.1 -> `fp8_v41` (528), V4 -> `fp8_v4` (584).
A ue8m0 scale byte e encodes 2^(e-127).

Small dims (tiny test models): the quant block is ``min(nominal block, dim)`` (for `fp8_v4`,
``min(64, nope dims)``); the dim must then be a multiple of that block, else ConfigError.
Example: head_dim 16 -> kv `fp4` 8 + 1 = 9 B, `fp8_v41` 16 + 1 = 17 B; index_head_dim 16 ->
`fp4` 9 B. `RowFormat.fake_quant` applies exactly that quantiser (via `kvshare.quant`), so models
should fake-quantise with it to keep the round trip exact.

Invariant (tested with rtol=0, atol=0): for y = fmt.fake_quant(x), ``unpack(pack(y)) == y``.
For arbitrary x, ``unpack(pack(x)) == fake_quant(x)`` except where another exact encoding of x
exists (then it is x itself). The e4m3-scaled fp4 quantiser is not idempotent on blocks whose
scale is an e4m3 subnormal, so `pack` falls back to searching the e4m3 scale that represents the
block exactly (amax / q for q on the fp4 grid) when re-quantising would change it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kvshare import quant
from kvshare.errors import ConfigError
from kvshare.kernels import rows as native_rows

Kind = Literal["kv", "index_k", "window"]
KINDS: tuple[str, ...] = ("kv", "index_k", "window")

# kind -> accepted names -> scheme (an arch-dependent name maps to None and is resolved below).
_NAMES: dict[str, dict[str, str | None]] = {
    "kv": {"fp4": "fp4_e4m3", "fp8": None, "fp8_v41": "fp8_v41", "fp8_v4": "fp8_v4", "bf16": "bf16", "fp32": "fp32",
           "fp64": "fp64"},
    "index_k": {"fp4": "fp4_ue8m0", "fp8": "fp8_row", "bf16": "bf16", "fp32": "fp32", "fp64": "fp64"},
    "window": {"fp8": None, "fp8_v41": "fp8_v41", "fp8_v4": "fp8_v4", "bf16": "bf16", "fp32": "fp32", "fp64": "fp64"},
}
# scheme -> canonical name shown to users and in layout ids.
_CANONICAL = {"fp4_e4m3": "fp4", "fp4_ue8m0": "fp4", "fp8_v41": "fp8_v41", "fp8_v4": "fp8_v4",
              "fp8_row": "fp8", "bf16": "bf16", "fp32": "fp32", "fp64": "fp64"}
_NOMINAL_BLOCK = {"fp4_e4m3": 16, "fp4_ue8m0": 32, "fp8_v41": 32, "fp8_v4": 64}

DEFAULT_FORMATS: dict[str, dict[str, str]] = {
    "v41": {"kv": "fp4", "index_k": "fp4", "window": "fp8_v41"},
    "v4": {"kv": "fp8_v4", "index_k": "fp4", "window": "fp8_v4"},
}


def _ue8m0_bytes(scale: torch.Tensor, check: bool = False) -> torch.Tensor:
    """Power-of-two fp32 scales -> biased-exponent bytes (2^(e-127)).

    The quantisers only make power-of-two scales in range, so the hot path does not look;
    ``check`` verifies it (two host reads of device values)."""
    mant, exp = torch.frexp(scale)
    e = exp.to(torch.int64) + 126
    if check:
        if not bool((mant == 0.5).all()):
            raise ValueError("ue8m0 scales must be powers of two")
        if bool(((e < 0) | (e > 254)).any()):
            raise ValueError("scale exponent outside the ue8m0 range 2^-127 .. 2^127")
    return e.to(torch.uint8)


def _ue8m0_values(b: torch.Tensor) -> torch.Tensor:
    return torch.exp2(b.to(torch.float32) - 127.0)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., n] (n even) -> bytes [..., n // 2]; element 2i in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


_EXACT_Q = (6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5)  # tried in this order: the first exact one wins


def _exact_fp4_e4m3(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 codes + e4m3 scales of x; blocks the quantiser would change get an exact encoding if one exists.

    The exact encoding of a block with absolute maximum a, if any, has scale a / q for a grid
    value q (the block's maximum is then code q): every q is tried at once for every block and the
    first exact one (in `_EXACT_Q` order) replaces the quantiser's result where that changed the
    block. No branch depends on the data, so nothing is read back to the host."""
    codes, scale = quant.fp4_codes(x, block, "e4m3")
    xb = x.float().reshape(*x.shape[:-1], -1, block)
    rec = quant.fp4_dequant(codes, scale, block).reshape(xb.shape)
    bad = (rec != xb).any(-1)  # [..., nb]: blocks re-quantising would change
    grid = quant.FP4_GRID.to(x.device)
    qs = torch.tensor(_EXACT_Q, dtype=torch.float32, device=x.device)
    s = xb.abs().amax(-1)[..., None] / qs  # [..., nb, 7] candidate scales
    v = xb[..., None, :] / s.clamp_min(torch.finfo(torch.float32).tiny)[..., None]  # [..., nb, 7, block]
    mag = v.abs()
    idx = torch.searchsorted(grid, mag.contiguous()).clamp_(max=grid.numel() - 1)
    ok = (s > 0) & (quant.e4m3_round(s) == s) & (grid[idx] == mag).all(-1)  # [..., nb, 7]
    pick = ok.to(torch.uint8).argmax(-1, keepdim=True)  # the first exact candidate (0 if none)
    use = bad & ok.any(-1)
    c = (idx | (((v < 0) & (idx > 0)).to(idx.dtype) << 3)).to(torch.uint8)
    c = c.gather(-2, pick[..., None].expand(*pick.shape, block)).squeeze(-2)
    codes = torch.where(use[..., None], c, codes.reshape(xb.shape))
    scale = torch.where(use, s.gather(-1, pick).squeeze(-1), scale)
    return codes.reshape(x.shape), scale


#: the row schemes stored as plain floats, and their dtype
_PLAIN_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
#: unpack dtypes the native codecs write (`kernels/rows.py`), and so the dtypes a native reader of
#: quantised rows decodes them to (`RowFormat.codec`); float64 reads decode in torch
DECODED_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class RowFormat:
    """One stored row: ``row_bytes == data_bytes + scale_bytes + pad_bytes``.

    `block` is the quant block actually used (0 for bf16 / fp32 / one-scale-per-row fp8);
    `rope_dim` is only meaningful for `fp8_v4` (the trailing dims kept as bf16).
    """

    kind: str
    name: str
    scheme: str
    dim: int
    arch: str
    rope_dim: int
    block: int
    data_bytes: int
    scale_bytes: int
    pad_bytes: int
    row_bytes: int

    @property
    def nope_dim(self) -> int:
        return self.dim - self.rope_dim if self.scheme == "fp8_v4" else self.dim

    @property
    def plain_dtype(self) -> torch.dtype | None:
        """The dtype of a row stored as plain values (bf16 / fp32 / fp64 rows), else None."""
        return _PLAIN_DTYPES.get(self.scheme) if self.row_bytes else None

    @property
    def codec(self) -> tuple[int, int, int] | None:
        """(scheme id, block, rope dims) for a native kernel that decodes these rows itself
        (`kernels.rows.SCHEMES`: the FP8 / FP4 schemes), None for the others."""
        sid = native_rows.SCHEMES.get(self.scheme)
        return None if sid is None or not self.row_bytes else (sid, self.block, self.rope_dim)

    @property
    def label(self) -> str:
        """e.g. ``fp4:288`` (canonical name and row bytes)."""
        return f"{self.name}:{self.row_bytes}"

    # ---- quantiser -------------------------------------------------------------------------
    def fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        """The model-side quantiser this format stores losslessly (same dtype as x)."""
        s = self.scheme
        if s == "fp4_e4m3":
            return quant.fake_quant_fp4(x, self.block, "e4m3")
        if s == "fp4_ue8m0":
            return quant.fake_quant_fp4(x, self.block, "ue8m0")
        if s == "fp8_v41":
            return quant.fake_quant_fp8(x, self.block, ue8m0=True)
        if s == "fp8_row":
            return quant.fake_quant_fp8(x, self.dim, ue8m0=True)
        if s == "fp8_v4":
            n = self.nope_dim
            nope = quant.fake_quant_fp8(x[..., :n], self.block, ue8m0=True)
            return torch.cat((nope, x[..., n:].to(torch.bfloat16).to(x.dtype)), dim=-1)
        if s == "bf16":
            return x.to(torch.bfloat16).to(x.dtype)
        if s == "fp64":
            return x.double().to(x.dtype)
        return x.float().to(x.dtype)

    # ---- bytes -----------------------------------------------------------------------------
    def pack(self, x: torch.Tensor, check: bool = False) -> torch.Tensor:
        """float [..., dim] -> uint8 [..., row_bytes] (data, scales, zero pad). `check`: verify the
        ue8m0 scales (host reads; tests), which the quantisers make valid by construction."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"{self.kind} row format {self.label} expects last dim {self.dim}, got {x.shape[-1]}")
        s = self.scheme
        if s in native_rows.SCHEMES and self.row_bytes and native_rows.serves(x):  # the same bytes in one call
            return native_rows.pack(s, x, self.block, self.rope_dim, self.row_bytes)
        lead = x.shape[:-1]
        if self.row_bytes == 0:
            return torch.zeros(*lead, 0, dtype=torch.uint8, device=x.device)
        if s == "fp32":
            return x.float().contiguous().view(torch.uint8)
        if s == "fp64":
            return x.double().contiguous().view(torch.uint8)
        if s == "bf16":
            return x.to(torch.bfloat16).contiguous().view(torch.uint8)
        if s in ("fp4_e4m3", "fp4_ue8m0"):
            if s == "fp4_e4m3":
                codes, scale = _exact_fp4_e4m3(x, self.block)
                sb = scale.to(torch.float8_e4m3fn).view(torch.uint8)
            else:
                codes, scale = quant.fp4_codes(x, self.block, "ue8m0")
                sb = _ue8m0_bytes(scale, check)
            parts = [_pack_nibbles(codes), sb]
        elif s == "fp8_v41":
            q, scale = quant.fp8_codes(x, self.block, ue8m0=True)
            parts = [q.view(torch.uint8), _ue8m0_bytes(scale, check)]
        elif s == "fp8_row":
            q, scale = quant.fp8_codes(x, self.dim, ue8m0=True)
            parts = [q.view(torch.uint8), scale.float().contiguous().view(torch.uint8)]
        else:  # fp8_v4
            n = self.nope_dim
            q, scale = quant.fp8_codes(x[..., :n], self.block, ue8m0=True)
            rope = x[..., n:].to(torch.bfloat16).contiguous().view(torch.uint8)
            parts = [q.view(torch.uint8), rope, _ue8m0_bytes(scale, check)]
        if self.pad_bytes:
            parts.append(torch.zeros(*lead, self.pad_bytes, dtype=torch.uint8, device=x.device))
        out = torch.cat([p.reshape(*lead, -1) for p in parts], dim=-1)
        assert out.shape[-1] == self.row_bytes
        return out

    def unpack(self, u8: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """uint8 [..., row_bytes] -> float32 [..., dim] (float64 for `fp64` rows), or `dtype`.

        Plain rows (bf16 / fp32 / fp64) convert straight to `dtype` (one copy: a bf16 row read as
        bf16 is not widened to fp32 and rounded back, which gives the same values); quantised rows
        are decoded in fp32, then rounded to `dtype`."""
        plain = _PLAIN_DTYPES.get(self.scheme)
        if (dtype in DECODED_DTYPES and self.scheme in native_rows.SCHEMES and self.row_bytes
                and native_rows.serves(u8)):  # the same bits in one call
            self._check(u8)
            return native_rows.unpack(self.scheme, u8, self.block, self.dim, self.rope_dim, dtype)
        if dtype is not None and plain is not None and self.row_bytes:
            self._check(u8)
            return u8.contiguous().view(plain).to(dtype, copy=True)
        out = self._decode(u8)
        return out if dtype is None else out.to(dtype)

    def _check(self, u8: torch.Tensor) -> None:
        if u8.dtype != torch.uint8 or u8.shape[-1] != self.row_bytes:
            raise ValueError(f"{self.kind} row format {self.label} expects uint8 [..., {self.row_bytes}], "
                             f"got {u8.dtype} [..., {u8.shape[-1]}]")

    def _decode(self, u8: torch.Tensor) -> torch.Tensor:
        """`unpack` in the format's own float dtype (float32, float64 for `fp64` rows)."""
        self._check(u8)
        u8 = u8.contiguous()
        s, d, db = self.scheme, self.dim, self.data_bytes
        if self.row_bytes == 0:
            return torch.zeros(*u8.shape[:-1], 0, dtype=torch.float32, device=u8.device)
        if s == "fp32":
            return u8.view(torch.float32).clone()
        if s == "fp64":
            return u8.view(torch.float64).clone()
        if s == "bf16":
            return u8.view(torch.bfloat16).float()
        data, sc = u8[..., :db], u8[..., db: db + self.scale_bytes]
        if s == "fp4_e4m3":
            scale = sc.contiguous().view(torch.float8_e4m3fn).float()
            return quant.fp4_dequant(_unpack_nibbles(data), scale, self.block)
        if s == "fp4_ue8m0":
            return quant.fp4_dequant(_unpack_nibbles(data), _ue8m0_values(sc), self.block)
        if s == "fp8_v41":
            return quant.fp8_dequant(data.contiguous().view(torch.float8_e4m3fn), _ue8m0_values(sc), self.block)
        if s == "fp8_row":
            scale = sc.contiguous().view(torch.float32)
            return quant.fp8_dequant(data.contiguous().view(torch.float8_e4m3fn), scale, d)
        n = self.nope_dim
        nope = quant.fp8_dequant(data[..., :n].contiguous().view(torch.float8_e4m3fn),
                                 _ue8m0_values(sc[..., : n // self.block]), self.block)
        rope = data[..., n:].contiguous().view(torch.bfloat16).float()
        return torch.cat((nope, rope), dim=-1)


def row_format(kind: str, name: str, dim: int, *, arch: str = "v41", rope_dim: int = 0,
               field: str | None = None) -> RowFormat:
    """Resolve a format name for a row kind ("kv", "index_k", "window") of width `dim`.

    Raises ConfigError (field = `field` or ``<kind>_format``) for unknown names or dims the
    format cannot hold.
    """
    fname = field or ("index_format" if kind == "index_k" else f"{kind}_format")
    if kind not in _NAMES:
        raise ConfigError(f"unknown row kind {kind!r}", field=fname, fix=f"use one of {KINDS}")
    names = _NAMES[kind]
    if name not in names:
        raise ConfigError(f"unknown {kind} format {name!r}", field=fname, fix=f"use one of {sorted(names)}")
    scheme = names[name] or ("fp8_v4" if arch == "v4" else "fp8_v41")
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
        raise ConfigError(f"row width must be a non-negative integer, got {dim!r}", field=fname)
    block, data, scales, pad, rd = 0, 0, 0, 0, 0
    if dim == 0:  # a model without an indexer: zero-width index rows, never stored
        pass
    elif scheme in ("fp64", "fp32", "bf16"):
        data = dim * {"fp64": 8, "fp32": 4, "bf16": 2}[scheme]
    elif scheme == "fp8_row":
        data, scales = dim, 4
    else:
        width = dim
        if scheme == "fp8_v4":
            rd = rope_dim
            if not 0 <= rd < dim or rd % 2:
                raise ConfigError(f"fp8_v4 needs an even rope dim in [0, {dim}), got {rd}", field=fname,
                                  fix="pass the model's qk_rope_head_dim")
            width = dim - rd
        block = min(_NOMINAL_BLOCK[scheme], width)
        if width % block or (scheme.startswith("fp4") and block % 2):
            raise ConfigError(f"{_CANONICAL[scheme]} rows of {width} values need a multiple of the quant "
                              f"block {block}", field=fname, fix="choose a bf16 or fp32 format for this dim")
        n_scales = width // block
        if scheme.startswith("fp4"):
            data, scales = width // 2, n_scales
        elif scheme == "fp8_v41":
            data, scales = width, n_scales
        else:
            data, scales = width + 2 * rd, n_scales
            pad = -(data + scales) % 8
    return RowFormat(kind=kind, name=_CANONICAL[scheme], scheme=scheme, dim=dim, arch=arch, rope_dim=rd,
                     block=block, data_bytes=data, scale_bytes=scales, pad_bytes=pad,
                     row_bytes=data + scales + pad)


def formats_for(cfg: object, kv: str | None = None, index: str | None = None,
                window: str | None = None) -> tuple[RowFormat, RowFormat, RowFormat]:
    """(kv, index_k, window) formats for a ModelConfig; None picks the architecture default."""
    arch = getattr(cfg, "arch")
    d = DEFAULT_FORMATS[arch]
    head, rope, idx_dim = cfg.head_dim, cfg.qk_rope_head_dim, cfg.index_head_dim  # type: ignore[attr-defined]
    kv_f = row_format("kv", kv or d["kv"], head, arch=arch, rope_dim=rope)
    win_f = row_format("window", window or d["window"], head, arch=arch, rope_dim=rope)
    ik_f = row_format("index_k", index or d["index_k"], max(idx_dim, 0), arch=arch)
    return kv_f, ik_f, win_f
