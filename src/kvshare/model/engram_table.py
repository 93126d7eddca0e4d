"""Engram tables (spec/engram_dspark.md §1.2, §1.7): FP8 rows with per-row scales, on the host.

Released layout of one Engram layer L (names relative to ``layers.L.engram.``):

* ``embed.weight``: F8_E4M3 ``[rows, d_e]``, one row per hash bucket;
* ``embed.scale``: F8_E8M0 ``[rows, d_e / 32]``: one power-of-two scale ``2^(byte - 127)`` per 32
  columns *of a row* (not the 32x32 block tiling of the linear weights).

Row r's value is ``codes[r].float().view(d_e/32, 32) * scale[r].view(d_e/32, 1)``; the product is
exact in bf16, fp32 and fp64. An `EngramTable` keeps both as uint8 numpy arrays on the CPU, beside
a model on any device:

* ``mmap`` (default): `numpy.memmap` views at the tensors' data offsets in the safetensors file.
  Only the pages of rows looked up are ever read, so resident memory stays far below the table
  size (the released tables are 189 GiB); rows come from the page cache or the disk.
* ``memory``: the tensors are read into RAM once (needed for serving speed: a cold lookup from
  disk costs a page fault per row).

A lookup gathers rows with one vectorised `numpy.take` per tensor and dequantises them in torch.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from kvshare.errors import CheckpointError
from kvshare.quant import fp8_codes

TableMode = Literal["mmap", "memory"]
TABLE_MODES = ("mmap", "memory")
DEFAULT_TABLE_MODE: TableMode = "mmap"
ROW_BLOCK = 32
_DTYPES = {"F8_E4M3": "e4m3", "F8_E8M0": "e8m0"}
# Every byte's value: e4m3 codes through torch's float8 cast, e8m0 scales 2^(byte - 127) (255 is NaN).
# Decoding by table lookup is exact and ~10x faster than casting float8 tensors on the CPU.
_E4M3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
_E8M0 = np.where(np.arange(256) == 255, np.nan, np.ldexp(1.0, np.arange(256) - 127)).astype(np.float32)


def table_names(layer: int) -> tuple[str, str]:
    """Released names of layer `layer`'s table codes and row scales."""
    return f"layers.{layer}.engram.embed.weight", f"layers.{layer}.engram.embed.scale"


def is_table_name(name: str) -> bool:
    """Whether a checkpoint tensor is an Engram table (read by `open_tables`, never loaded whole)."""
    return ".engram.embed." in name and name.startswith("layers.")


@dataclass
class EngramTable:
    """One layer's table: ``codes`` uint8 [rows, d_e] (e4m3 bits), ``scales`` uint8 [rows, d_e / 32] (e8m0)."""

    codes: np.ndarray
    scales: np.ndarray
    mode: TableMode

    @property
    def rows(self) -> int:
        return int(self.codes.shape[0])

    @property
    def dim(self) -> int:
        return int(self.codes.shape[1])

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes + self.scales.nbytes)

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantised rows [*ids.shape, d_e] in `dtype` (CPU) for row ids (any shape, int)."""
        flat = ids.reshape(-1).to("cpu", torch.int64).numpy()
        if flat.size and (flat.min() < 0 or flat.max() >= self.rows):
            raise IndexError(f"Engram row id outside the table (rows {self.rows})")
        codes = _E4M3[np.take(self.codes, flat, axis=0)].reshape(flat.size, -1, ROW_BLOCK)
        scales = _E8M0[np.take(self.scales, flat, axis=0)]
        rows = torch.from_numpy(codes * scales[:, :, None])
        return rows.view(*ids.shape, self.dim).to(dtype)

    def to_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes as float8_e4m3fn, scales as float8_e8m0fnu) torch tensors, for writing a checkpoint."""
        return (torch.from_numpy(np.array(self.codes)).view(torch.float8_e4m3fn),
                torch.from_numpy(np.array(self.scales)).view(torch.float8_e8m0fnu))

    @classmethod
    def quantize(cls, values: torch.Tensor) -> "EngramTable":
        """An in-memory table holding `values` [rows, d_e] rounded to FP8 with ue8m0 row scales."""
        q, s = fp8_codes(values.float(), ROW_BLOCK, ue8m0=True)
        exps = (torch.log2(s).round().to(torch.int32) + 127).to(torch.uint8)
        return cls(q.view(torch.uint8).numpy().copy(), exps.numpy().copy(), "memory")

    @classmethod
    def random(cls, rows: int, dim: int, generator: torch.Generator) -> "EngramTable":
        """Unit-normal values, quantised (tiny test models)."""
        return cls.quantize(torch.randn(rows, dim, generator=generator))


# ---- safetensors ------------------------------------------------------------------------------


def safetensors_header(path: Path) -> tuple[dict, int]:
    """(header dict without `__metadata__`, byte offset where the data section starts)."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: unreadable safetensors header: {e}") from e
    header.pop("__metadata__", None)
    return header, 8 + n


def _array(path: Path, info: dict, data_start: int, name: str, want_dtype: str, shape: tuple[int, int],
           mode: TableMode) -> np.ndarray:
    got_dtype, got_shape = info.get("dtype"), tuple(info.get("shape", ()))
    if _DTYPES.get(got_dtype) != want_dtype:
        raise CheckpointError(f"tensor `{name}` has dtype {got_dtype}, expected "
                              f"{'F8_E4M3' if want_dtype == 'e4m3' else 'F8_E8M0'} (Engram table layout)")
    if got_shape != shape:
        raise CheckpointError(f"tensor `{name}` has shape {list(got_shape)}, expected {list(shape)}")
    begin, end = info["data_offsets"]
    if end - begin != shape[0] * shape[1]:
        raise CheckpointError(f"tensor `{name}`: {end - begin} data bytes for shape {list(shape)}")
    offset = data_start + begin
    if mode == "mmap":
        return np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=shape)
    return np.fromfile(path, dtype=np.uint8, count=shape[0] * shape[1], offset=offset).reshape(shape)


def open_tables(files: list[Path], layers: tuple[int, ...], rows: tuple[int, ...], dim: int,
                mode: TableMode = DEFAULT_TABLE_MODE) -> dict[int, EngramTable]:
    """The Engram table of each layer from the checkpoint's safetensors files (names, dtypes, shapes
    checked; a missing or mis-shaped tensor is named in the CheckpointError)."""
    if mode not in TABLE_MODES:
        raise ValueError(f"engram table mode {mode!r}: use one of {TABLE_MODES}")
    where: dict[str, tuple[Path, dict, int]] = {}
    for f in files:
        header, start = safetensors_header(f)
        for name, info in header.items():
            if is_table_name(name):
                where[name] = (f, info, start)
    out: dict[int, EngramTable] = {}
    for layer, n in zip(layers, rows):
        arrays = []
        for name, kind, shape in zip(table_names(layer), ("e4m3", "e8m0"), ((n, dim), (n, dim // ROW_BLOCK))):
            if name not in where:
                raise CheckpointError(f"missing tensor `{name}` (expected shape {list(shape)}, Engram table of "
                                      f"layer {layer})")
            f, info, start = where[name]
            arrays.append(_array(f, info, start, name, kind, shape, mode))
        out[layer] = EngramTable(arrays[0], arrays[1], mode)
    extra = set(where) - {n for layer in layers for n in table_names(layer)}
    if extra:
        raise CheckpointError(f"unexpected tensor `{sorted(extra)[0]}`: not an Engram layer of this config")
    return out
