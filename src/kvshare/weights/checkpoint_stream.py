"""Streaming a released-naming checkpoint into a model whose weights were never written, tensor by tensor.

`stream_into(model, entries, cfg, dtype, keep_packed, block)` gives every parameter and persistent
buffer of `model` (built without writing its weights: `loader._unfilled_model`, or on the meta device)
its checkpoint value, replacing the tensor, so the whole-model intermediates of reading a state dict
first never exist (no fp32 model skeleton, no dict of every tensor, no dequantised
copy of a packed weight). Invariants:

* FP8 / FP4 weights named in `keep_packed` are read (``readinto``, not mapped) and repacked into their
  `kernels.Packed` (`Linear.set_packed`); the stored bytes pass through memory once, as one tensor's
  transient. Other quantised weights are dequantised to fp32 one at a time, then cast.
* A plain tensor whose stored dtype is already the one the model keeps (`final_dtype`: bf16 weights of
  a bf16 model, fp32 norms...) is served from a private, copy-on-write map of the file (weights in the
  page cache, shared by every process reading the file; resident only as far as they are used); any
  other is read and converted, one tensor at a time.
* The values are those `load_checkpoint` + `load_state_into` + `cast_model` give (the same casts in the
  same order: fp32 -> model dtype; stored -> buffer dtype), so a model loaded either way computes the
  same bits. Missing, unexpected and mis-shaped tensors raise CheckpointError, as `check_state_dict`.
"""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from kvshare.config import ModelConfig
from kvshare.errors import CheckpointError
from kvshare.weights import weights_quant as wq

ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
if hasattr(torch, "float8_e8m0fnu"):
    ST_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu
if hasattr(torch, "float4_e2m1fn_x2"):
    ST_DTYPES["F4"] = torch.float4_e2m1fn_x2


TRIM_EVERY = 64 * 2**20  # bytes streamed between heap trims (`release_free_heap`)


@dataclass(frozen=True)
class Entry:
    """One stored tensor: its file, dtype, shape and absolute byte range in the file."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def index_files(files: list[Path]) -> dict[str, Entry]:
    """Every tensor of the safetensors `files` with its byte range (headers only; CheckpointError naming
    the file for anything malformed, a dtype kvshare cannot hold, or a name in two files)."""
    out: dict[str, Entry] = {}
    for f in files:
        try:
            size = f.stat().st_size
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
        except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{f}: unreadable safetensors header: {e}") from e
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = ST_DTYPES[info["dtype"]]
                shape = tuple(int(s) for s in info["shape"])
                lo, hi = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointError(f"{f}: tensor `{name}` has a malformed or unsupported header entry "
                                      f"({info!r:.200})") from e
            if not 0 <= lo <= hi <= size - 8 - n or hi - lo != math.prod(shape) * dtype.itemsize:
                raise CheckpointError(f"{f}: tensor `{name}` has data offsets that do not fit its shape or the file")
            if name in out:
                raise CheckpointError(f"tensor `{name}` appears in more than one shard ({f.name})")
            out[name] = Entry(f, dtype, shape, 8 + n + lo, 8 + n + hi)
    return out


class Reader:
    """Reads entries (``readinto`` a new tensor) or maps them (a view of a private map of the file)."""

    def __init__(self) -> None:
        self._files: dict[Path, object] = {}
        self._maps: dict[Path, mmap.mmap] = {}

    def read(self, e: Entry) -> torch.Tensor:
        """A new tensor holding the entry's bytes."""
        fh = self._files.get(e.file)
        if fh is None:
            fh = self._files[e.file] = open(e.file, "rb")
        buf = torch.empty(e.end - e.start, dtype=torch.uint8)
        fh.seek(e.start)  # type: ignore[attr-defined]
        if buf.numel() and fh.readinto(memoryview(buf.numpy())) != buf.numel():  # type: ignore[attr-defined]
            raise CheckpointError(f"{e.file}: file ends inside a tensor's data")
        return buf.view(e.dtype).reshape(e.shape)

    def map(self, e: Entry) -> torch.Tensor | None:
        """A tensor over the file's pages (copy-on-write), or None where its offset is not aligned."""
        if e.start % e.dtype.itemsize or e.end == e.start:
            return None
        mm = self._maps.get(e.file)
        if mm is None:
            with open(e.file, "rb") as fh:
                mm = self._maps[e.file] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        n = (e.end - e.start) // e.dtype.itemsize
        return torch.frombuffer(mm, dtype=e.dtype, count=n, offset=e.start).reshape(e.shape)

    def close(self) -> None:
        """Close the read handles (maps stay alive while tensors view them)."""
        for fh in self._files.values():
            fh.close()  # type: ignore[attr-defined]
        self._files.clear()
        self._maps.clear()


def final_dtype(module: nn.Module, leaf: str, current: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """The dtype `cast_model(model, dtype)` gives this parameter (before the compressor promotion,
    which `cast_model` itself applies afterwards); buffers keep theirs unless floating."""
    from kvshare.model.dtypes import _keeps_fp32

    if not current.is_floating_point:
        return current
    if dtype.itemsize < 4 and _keeps_fp32(module, leaf):
        return torch.float32
    return dtype


def scale_owner(name: str, tensors: Mapping[str, object]) -> str | None:
    """The weight a scale tensor belongs to (None: `name` is not a scale of a present weight):
    ``<module>.weight_scale_inv`` -> ``<module>.weight``; ``<stem>.scale`` -> ``<stem>.weight`` or ``<stem>``."""
    if name.endswith(".weight_scale_inv"):
        cands = [name[: -len("_scale_inv")]]
    elif name.endswith(".scale"):
        stem = name[: -len(".scale")]
        cands = [stem + ".weight", stem]
    else:
        return None
    return next((c for c in cands if c in tensors and c != name), None)


def _scales(entries: dict[str, Entry]) -> dict[str, str]:
    """Weight name -> its scale's name, for FP8 / packed-FP4 weights (`scale_owner`)."""
    out: dict[str, str] = {}
    for name, e in entries.items():
        if (name.endswith(".scale") or name.endswith("_scale_inv")) and e.dtype.is_floating_point:
            owner = scale_owner(name, entries)
            if owner is not None and entries[owner].dtype in (torch.float8_e4m3fn, *wq._PACKED_FP4_DTYPES):
                out[owner] = name
    return out


def _quantised(name: str, w: torch.Tensor, s: torch.Tensor, block: tuple[int, int], pack: bool):
    """A quantised weight as `kernels.Packed` (when `pack` and the kernels can hold it) or fp32."""
    if pack and w.dim() == 2:
        from kvshare import kernels

        try:
            return kernels.pack_fp8(w, s, block) if wq.is_fp8(w) else kernels.pack_fp4(w, s)
        except ValueError:
            pass
    try:
        return wq.dequant_fp8_weight(w, s, block) if wq.is_fp8(w) else wq.dequant_fp4_weight(w, s)
    except ValueError as e:
        raise CheckpointError(f"tensor `{name}`: {e}") from e


def stream_into(model: nn.Module, entries: dict[str, Entry], cfg: ModelConfig, dtype: torch.dtype,
                keep_packed: frozenset[str], block: tuple[int, int], map_plain: bool = True) -> None:
    """Fill `model` (weights unwritten) from `entries` (released names; see module doc)."""
    scales = _scales(entries)
    used = set(scales.values())
    slots: dict[str, tuple[nn.Module, str, torch.Tensor, bool]] = {}
    for mod_name, module in model.named_modules():
        for leaf, p in module.named_parameters(recurse=False):
            slots[f"{mod_name}.{leaf}" if mod_name else leaf] = (module, leaf, p, True)
        for leaf, b in module.named_buffers(recurse=False):
            if leaf not in module._non_persistent_buffers_set:
                slots[f"{mod_name}.{leaf}" if mod_name else leaf] = (module, leaf, b, False)
    for name in entries:
        if name not in slots and name not in used:
            e = entries[name]
            raise CheckpointError(f"unexpected tensor `{name}` (shape {list(e.shape)}): not part of this config")
    for name, (_, _, t, _) in slots.items():
        if name not in entries:
            raise CheckpointError(f"missing tensor `{name}` (expected shape {list(t.shape)})")
    reader = Reader()
    since_trim = 0
    try:
        for name, (module, leaf, t, is_param) in slots.items():
            e = entries[name]
            since_trim += e.end - e.start
            if since_trim > TRIM_EVERY:  # freed read buffers would otherwise stay resident until the end
                release_free_heap()
                since_trim = 0
            final = _final(module, leaf, t, is_param, dtype)
            if name in scales:
                logical = e.shape if e.dtype == torch.float8_e4m3fn else (*e.shape[:-1], 2 * e.shape[-1])
                _check_shape(name, logical, tuple(t.shape))
                value = _quantised(name, reader.read(e), reader.read(entries[scales[name]]), block,
                                   name in keep_packed)
                if not isinstance(value, torch.Tensor):
                    module.set_packed(value)  # type: ignore[operator]
                    continue
            else:
                if e.dtype == torch.float8_e4m3fn or (e.dtype in wq._PACKED_FP4_DTYPES and t.is_floating_point()):
                    raise CheckpointError(f"tensor `{name}` is quantised ({e.dtype}) but has no `.scale` companion")
                _check_shape(name, e.shape, tuple(t.shape))
                value = reader.map(e) if map_plain and e.dtype == final else None
                if value is None:
                    value = reader.read(e)
            if value.dtype.itemsize > t.dtype.itemsize and t.is_floating_point():
                value = value.to(t.dtype)  # the rounding the old path made by copying into the fp32 model
            value = value.to(final)
            if is_param:
                module._parameters[leaf] = nn.Parameter(value, requires_grad=t.requires_grad)
            else:
                module._buffers[leaf] = value
    finally:
        reader.close()


def _final(module: nn.Module, leaf: str, t: torch.Tensor, is_param: bool, dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor ends with after `load_state_into` + `cast_model` (before the compressor
    promotion, which `cast_model` applies itself): integer buffers keep theirs, floating buffers take
    fp32 in a narrow model (else the model dtype), parameters follow `final_dtype`."""
    if not t.is_floating_point():
        return t.dtype
    if not is_param:
        return torch.float32 if dtype.itemsize < 4 else dtype
    return final_dtype(module, leaf, t.dtype, dtype)


def release_free_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere): the
    per-tensor transients of `stream_into` are freed, but glibc keeps freed heap memory resident."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _check_shape(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise CheckpointError(f"tensor `{name}` has shape {list(got)}, expected {list(want)}")
