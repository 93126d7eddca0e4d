"""Checkpoint files, safely: which files to read, their headers, and shapes before allocation.

* `weight_files(path)`: the safetensors files of a checkpoint. Shards named by an index file must
  stay inside the model directory (no absolute paths, no ``..`` escapes, no symlinks out). A
  directory with no safetensors is refused, with a pointed message when it holds only pickle
  checkpoints (``pytorch_model.bin``...), which kvshare never loads (unpickling runs code).
* `read_header(file)`: tensor name -> (dtype, shape) from the safetensors header alone (8-byte
  length + JSON), checked for size and consistency; every error names the file.
* `check_header_shapes(files, cfg, expected)`: the embedding, head, norm and every unquantised
  released-naming tensor are compared with the config's shapes, and the checkpoint must hold
  every backbone layer, all before any model or pool memory is allocated.
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
_PLAIN_DTYPES = {"F64", "F32", "F16", "BF16"}
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


def _inside(directory: Path, name: str, index: Path) -> Path:
    """`directory / name`, unless it resolves (absolute path, ``..``, symlink) outside `directory`."""
    f = directory / name
    if not f.resolve().is_relative_to(directory.resolve()):
        raise CheckpointError(f"{index} names shard {name!r}, which resolves outside the model directory")
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
        return [p / SINGLE_FILE]
    files = sorted(p.glob("*.safetensors"))
    if not files:
        refuse_pickle_only(p)
        raise CheckpointError(f"no .safetensors files in {p}")
    return files


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


def check_header_shapes(files: list[Path], num_layers: int, expected: dict[str, tuple[int, ...]]) -> None:
    """Compare the checkpoint's header shapes with `expected` (released naming) before allocation."""
    layers: set[int] = set()
    for f in files:
        for name, (dtype, shape) in read_header(f).items():
            m = _LAYER.match(name)
            if m:
                layers.add(int(m.group(1)))
            twin = _HF_TWINS.get(name, name)
            if twin in expected and dtype in _PLAIN_DTYPES and shape != tuple(expected[twin]):
                raise CheckpointError(f"{f.name}: tensor `{name}` has shape {list(shape)}, but the config "
                                      f"expects {list(expected[twin])}; the config does not match these weights")
    missing = sorted(set(range(num_layers)) - layers)
    if missing:
        raise CheckpointError(f"the config has {num_layers} layers but the checkpoint has no tensors for layer "
                              f"{missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))


def describe(e: Exception, f: Any) -> CheckpointError:
    """A safetensors read error as a CheckpointError naming the file."""
    return CheckpointError(f"{f}: cannot read safetensors data: {type(e).__name__}: {e}")
