"""Checkpoint files, safely: which files to read, their headers, and shapes before allocation.

* `weight_files(path)`: the safetensors files of a checkpoint. Shards named by an index file must
  stay inside the model directory (no absolute paths, no ``..`` escapes, no symlinks out). A
  directory with no safetensors is refused, with a pointed message when it holds only pickle
  checkpoints (``pytorch_model.bin``...), which kvshare never loads (unpickling runs code).
* `read_header(file)`: tensor name -> (dtype, shape) from the safetensors header alone (8-byte
  length + JSON), checked for size and consistency; every error names the file.
* `check_header_shapes(files, num_layers, expected, block)`: every released-naming tensor (and
  the embedding, head and norm in transformers naming) is compared with the config's shape in
  its stored form, whatever its dtype: plain and FP8 (F8_E4M3) weights as they are, packed FP4
  (I8 / U8 / F4) weights with the input dim halved, and each weight's scale (`.scale` /
  `.weight_scale_inv`, F8_E8M0 or float) with the shape its format needs (FP8: one per (bo x
  bi) block; FP4: one per 32 inputs). The checkpoint must hold every backbone layer. All of
  this reads headers only, so a wrong shape is refused before any tensor data is read or any
  model or pool memory is allocated.
* Every weight file, the single `model.safetensors` and a lone ``*.safetensors`` included,
  must resolve inside the model directory (a symlink out is refused).
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

from kvshare.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
MAX_HEADER_BYTES = 100 * 2**20
_PACKED_FP4_DTYPES = {"I8", "U8", "F4"}
_FP4_BLOCK = 32  # inputs per scale of an FP4 weight (released checkpoints)
_SCALE_SUFFIXES = (".weight_scale_inv", ".scale")
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")
# transformers names whose released twin is known without the full mapping
_HF_TWINS = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
             "model.norm.weight": "norm.weight"}


def pickle_files(directory: Path) -> list[Path]:
    """Pickle checkpoints in `directory` (never loaded; named in the refusal)."""
    return sorted(p for p in directory.iterdir() if p.is_file() and p.name.endswith(PICKLE_SUFFIXES))


def refuse_pickle_only(directory: Path) -> None:
    """CheckpointError when `directory` holds pickle checkpoints but no safetensors."""
    if directory.is_dir() and not any(directory.glob("*.safetensors")) and not (directory / INDEX_FILE).is_file():
        found = pickle_files(directory)
        if found:
            raise CheckpointError(
                f"{directory} holds only pickle checkpoints ({', '.join(p.name for p in found[:3])}); kvshare "
                "loads safetensors only, since unpickling can run arbitrary code. Convert them with "
                "transformers (`model.save_pretrained(dir, safe_serialization=True)`) or safetensors")


def _inside(directory: Path, name: str, named_by: Path | None = None) -> Path:
    """`directory / name`, unless it resolves (absolute path, ``..``, symlink) outside `directory`."""
    f = directory / name
    if not f.resolve().is_relative_to(directory.resolve()):
        who = f"{named_by} names shard {name!r}, which" if named_by else f"{f}"
        raise CheckpointError(f"{who} resolves outside the model directory ({f.resolve()}); "
                              "kvshare reads weights only from inside it")
    return f


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint (a file, or a directory; sharded via the index file)."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise CheckpointError(f"no checkpoint at {p}")
    index = p / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = list(dict.fromkeys(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from e
        if not all(isinstance(n, str) for n in names):
            raise CheckpointError(f"{index}: weight_map values must be file names")
        files = [_inside(p, n, index) for n in names]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index} lists shard {f.name}, which does not exist")
        return files
    if (p / SINGLE_FILE).is_file():
        return [_inside(p, SINGLE_FILE)]
    files = sorted(p.glob("*.safetensors"))
    if not files:
        refuse_pickle_only(p)
        raise CheckpointError(f"no .safetensors files in {p}")
    return [_inside(p, f.name) for f in files]


def read_header(f: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (dtype, shape) from a safetensors file's header; CheckpointError naming `f`."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{f}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(f"{f}: not a safetensors file (header length {n} for a {size}-byte file)")
            header = json.loads(fh.read(n))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f}: unreadable safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{f}: the safetensors header is not a JSON object")
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (lo, hi) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
        except (TypeError, KeyError, ValueError) as e:
            raise CheckpointError(f"{f}: tensor `{name}` has a malformed header entry: {e}") from e
        if not 0 <= lo <= hi <= size - 8 - n or any(s < 0 for s in shape):
            raise CheckpointError(f"{f}: tensor `{name}` has data offsets or a shape outside the file")
        out[name] = (dtype, shape)
    return out


def check_header_shapes(files: list[Path], num_layers: int, expected: dict[str, tuple[int, ...]],
                        block: tuple[int, int] | None = None) -> None:
    """Compare the checkpoint's header shapes (every dtype, scales included) with `expected` (released
    naming) before any tensor data is read. `block`: the FP8 weight block (bo, bi) scales are checked
    against (None: FP8 scales are not checked)."""
    layers: set[int] = set()
    headers: dict[str, tuple[str, tuple[int, ...], Path]] = {}
    for f in files:
        for name, (dtype, shape) in read_header(f).items():
            m = _LAYER.match(name)
            if m:
                layers.add(int(m.group(1)))
            twin = _HF_TWINS.get(name, name)
            headers[twin] = (dtype, shape, f)
            if twin in expected:
                want = stored_shape(twin, dtype, tuple(expected[twin]))
                if shape != want:
                    raise CheckpointError(f"{f.name}: tensor `{name}` has shape {list(shape)} ({dtype}), but the "
                                          f"config expects {list(want)}; the config does not match these weights")
    for name, (dtype, shape, f) in headers.items():
        owner = _scale_owner(name, headers, expected)
        if owner is None:
            continue
        need = _scale_misfit(headers[owner][0], tuple(expected[owner]), shape, block)
        if need is not None:
            raise CheckpointError(f"{f.name}: scale `{name}` ({dtype}) has shape {list(shape)}, but its weight "
                                  f"`{owner}` ({headers[owner][0]}) needs {need}")
    missing = sorted(set(range(num_layers)) - layers)
    if missing:
        raise CheckpointError(f"the config has {num_layers} layers but the checkpoint has no tensors for layer "
                              f"{missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))


def stored_shape(name: str, dtype: str, logical: tuple[int, ...]) -> tuple[int, ...]:
    """The header shape of a tensor of `logical` shape stored as `dtype`: packed FP4 halves the last dim
    (two codes per byte); everything else (plain, FP8, integer tables such as `tid2eid`) is as is."""
    if dtype in _PACKED_FP4_DTYPES and not name.endswith("tid2eid") and logical and logical[-1] % 2 == 0:
        return (*logical[:-1], logical[-1] // 2)
    return logical


def _scale_owner(name: str, headers: dict[str, Any], expected: dict[str, tuple[int, ...]]) -> str | None:
    """The expected weight `name` is the scale of (None: not a scale of a checked weight)."""
    for suffix in _SCALE_SUFFIXES:
        if name.endswith(suffix):
            stem = name[: -len(suffix)]
            for owner in (stem + ".weight", stem) if suffix == ".scale" else (stem + ".weight",):
                if owner != name and owner in expected and owner in headers:
                    return owner
    return None


def _scale_misfit(weight_dtype: str, logical: tuple[int, ...], shape: tuple[int, ...],
                  block: tuple[int, int] | None) -> str | None:
    """What scale shape a weight stored as `weight_dtype` needs, when `shape` is not it (else None).

    FP8: one per (bo x bi) block, [..., ceil(out / bo), ceil(in / bi)]. FP4: [..., out, in / k] with k
    dividing the input dim (32 in released checkpoints; `dequant_fp4_weight` reads k from the shapes)."""
    if len(logical) < 2:
        return None
    *lead, rows, cols = logical
    if weight_dtype == "F8_E4M3" and block is not None:
        want = (*lead, -(-rows // block[0]), -(-cols // block[1]))
        return None if shape == want else str(list(want))
    if weight_dtype in _PACKED_FP4_DTYPES:
        fits = shape[:-1] == (*lead, rows) and len(shape) == len(logical) and 0 < shape[-1] <= cols \
            and cols % shape[-1] == 0
        return None if fits else f"{[*lead, rows, cols // _FP4_BLOCK]} (one scale per {_FP4_BLOCK} inputs)"
    return None


def describe(e: Exception, f: Any) -> CheckpointError:
    """A safetensors read error as a CheckpointError naming the file."""
    return CheckpointError(f"{f}: cannot read safetensors data: {type(e).__name__}: {e}")
