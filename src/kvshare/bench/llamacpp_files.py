"""The files the llama.cpp peer needs: llama.cpp's GGUF converter, and the bf16 / q8_0 GGUFs.

llama.cpp runs through ``llama-cpp-python`` (``pip install 'kvshare[llamacpp]'``, pinned to
``LLAMA_CPP_PYTHON``; pip compiles the llama.cpp it vendors). Its wheel does not ship the converter
(``convert_hf_to_gguf.py`` with its ``conversion/`` package and ``gguf-py``), so the converter is
taken from the same pinned sdist, in this order:

1. ``$KVSHARE_LLAMACPP_SRC``: a llama.cpp source directory (holding ``conversion/`` and ``gguf-py/``);
2. the cache ``$XDG_CACHE_HOME/kvshare/llama-cpp-python-<version>/vendor/llama.cpp`` (default
   ``~/.cache/...``), filled by ``fetch_converter``: ``pip download llama-cpp-python==<version>
   --no-deps --no-binary :all:`` and extracting the converter's files (only when the benchmark is
   allowed to fetch; tests never do).

``write_ggufs`` saves the benchmark model as a checkpoint (``config.json`` + safetensors, released
naming) and converts it twice with ``kvshare.bench.gguf_v4`` in a subprocess (the converter's
modules stay out of this process): in the checkpoint's dtype, and q8_0.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

LLAMA_CPP_PYTHON = "0.3.36"
_SDIST = f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
_CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def binding_available() -> str | None:
    """None when ``llama_cpp`` imports at the pinned version; else the one-line reason it cannot run."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install 'kvshare[llamacpp]')"
    import importlib.metadata as md

    try:
        got = md.version("llama-cpp-python")
    except md.PackageNotFoundError:
        got = "unknown"
    if got != LLAMA_CPP_PYTHON:
        return f"llama-cpp-python {got} is installed; the peer is pinned to {LLAMA_CPP_PYTHON}"
    return None


def cache_dir() -> Path:
    """Where `fetch_converter` puts the converter."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "kvshare" / f"llama-cpp-python-{LLAMA_CPP_PYTHON}"


def _is_converter(d: Path) -> bool:
    return (d / "conversion" / "deepseek.py").is_file() and (d / "gguf-py" / "gguf").is_dir()


def converter_dir() -> Path | None:
    """The llama.cpp source directory holding the converter, or None when there is none yet."""
    env = os.environ.get("KVSHARE_LLAMACPP_SRC")
    if env:
        d = Path(env)
        if not _is_converter(d):
            raise FileNotFoundError(f"KVSHARE_LLAMACPP_SRC={env} holds no conversion/deepseek.py and gguf-py/gguf")
        return d
    d = cache_dir() / "vendor" / "llama.cpp"
    return d if _is_converter(d) else None


def fetch_converter() -> Path:
    """Download the pinned sdist with pip and extract the converter into `cache_dir()`; returns its directory."""
    dest = cache_dir()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
                        "--no-deps", "--no-binary", ":all:", "-d", tmp, "-q"], check=True)
        archives = list(Path(tmp).glob("*.tar.gz"))
        if not archives:
            raise FileNotFoundError(f"pip download left no sdist archive in {tmp}")
        prefix = f"{_SDIST}/vendor/llama.cpp/"
        with tarfile.open(archives[0]) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)
                       and m.name[len(prefix):].startswith(_CONVERTER_PARTS) and (m.isfile() or m.isdir())]
            for m in members:
                m.name = m.name[len(_SDIST) + 1:]
            dest.mkdir(parents=True, exist_ok=True)
            tar.extractall(dest, members=members, filter="data")
    d = dest / "vendor" / "llama.cpp"
    if not _is_converter(d):
        raise FileNotFoundError(f"the sdist's converter was not found after extracting into {dest}")
    return d


def convert_checkpoint(ckpt_dir: Path, out: Path, converter: Path, outtype: str = "bf16") -> Path:
    """Run `kvshare.bench.gguf_v4` on `ckpt_dir` with `converter` on PYTHONPATH; returns `out`."""
    src = Path(__file__).resolve().parents[2]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(src), str(converter), str(converter / "gguf-py"),
                                         env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    done = subprocess.run([sys.executable, "-m", "kvshare.bench.gguf_v4", str(ckpt_dir), str(out),
                           "--outtype", outtype], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"GGUF conversion failed ({done.returncode}): {done.stderr[-2000:]}")
    return out


def write_ggufs(model: Any, cfg: Any, out_dir: Path, converter: Path, dtype_label: str) -> dict[str, Path]:
    """The model's weights as ``{dtype_label: <checkpoint dtype GGUF>, "q8_0": <quantised GGUF>}``."""
    from kvshare.weights.checkpoint_write import save_checkpoint

    ckpt = save_checkpoint(model, cfg, out_dir / "ckpt")
    out = {label: convert_checkpoint(ckpt, out_dir / f"model-{label}.gguf", converter, label)
           for label in (dtype_label, "q8_0")}
    for f in ckpt.iterdir():  # the checkpoint is only the converter's input
        f.unlink()
    ckpt.rmdir()
    return out
