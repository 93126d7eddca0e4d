"""Build (once) and load the native kernel library; choose its code path.

The C++ sources in ``csrc/`` are compiled by `torch.utils.cpp_extension.load` on first use into
``$KVSHARE_KERNEL_CACHE`` (default ``~/.cache/kvshare/kernels``), in a folder keyed by the sources'
hash, the compiler flags and the torch version, so a later process (or test) loads the cached
library in milliseconds. The library is a plain shared object (no Python module): each C++ unit
registers its ops with schemas in the ``kvshare`` torch library, so loading it makes them
``torch.ops.kvshare.<op>``; `library()` returns that namespace, after registering the ops' fake
(meta) implementations (`fake_ops.py`) so torch.compile / torch.export can trace through them.
A build prints one line to stderr when it starts and one when it ends (with its time): the first
run of a fresh install compiles for 1-4 minutes. A machine without a compiler or ninja, or any
build error, gets ``None`` here and a single ``logging.warning``; callers then use the pure-torch
path (`fallback.py`). Nothing raises.

Code path (`isa`): ``"amx"`` (AMX-BF16 tiles for weights whose K is a multiple of 32, AVX-512 BF16
for the others) where the CPU and OS allow it, else ``"avx512"`` (AVX-512 BF16: ``vdpbf16ps``), else
``"avx2"`` (AVX2 + FMA), else ``"torch"``. torch's own switch ``ATEN_CPU_CAPABILITY=avx2`` caps it at AVX2 and
``=default`` at the torch path, so the suite can run each path on one machine;
``KVSHARE_KERNELS=off`` also selects the torch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
#: translation units; the ``*_ops.cpp`` units, gemm_run.cpp, fp8.cpp, gate.cpp, rows.cpp, moe.cpp,
#: attn_proj.cpp and pack_set.cpp register the ops (the others are torch-free compute compiled for one ISA each)
SOURCES = ("gemm_run.cpp", "gemm_avx512.cpp", "gemm_avx512_vbmi.cpp", "gemm_avx2.cpp", "gemm_amx.cpp", "fp8.cpp",
           "decode.cpp", "decode_ops.cpp", "gate.cpp", "rows.cpp", "moe.cpp", "attn.cpp", "index.cpp", "attn_ops.cpp",
           "mhc.cpp", "mhc_ops.cpp", "packed_gemm.cpp", "attn_proj.cpp", "pack_set.cpp")
_HEADERS = ("checks.h", "gemm.h", "gemm_run.h", "gemm_body.h", "gemm_avx512_unit.h", "fp8.h", "decode.h", "weights512.h",
            "rows.h", "row_codec.h", "lanes8.h", "moe.h", "attn.h", "index.h", "mhc.h", "packed_gemm.h", "attn_proj.h",
            "pack_set.h")


def cache_root() -> Path:
    """Where built libraries are kept (``$KVSHARE_KERNEL_CACHE`` or ``~/.cache/kvshare/kernels``)."""
    env = os.environ.get("KVSHARE_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kvshare" / "kernels"


#: compiler flags (part of the cache key). -fopenmp: the kernels' ``at::parallel_for`` splits rows /
#: weight groups over torch's intra-op threads (without it the loop runs on the calling thread);
#: every split leaves each output's arithmetic unchanged, so the bits do not depend on the threads.
CFLAGS = ["-O3", "-fno-math-errno", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


def source_hash() -> str:
    """Hash of every source and header file, the compiler flags and the torch version (the cache key)."""
    h = hashlib.sha256(torch.__version__.encode())
    h.update(" ".join(CFLAGS + LDFLAGS).encode())
    for name in SOURCES + _HEADERS:
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    return h.hexdigest()[:16]


#: a build lock older than this was left by a killed build (a real build takes ~1 minute)
STALE_LOCK_S = 600


def _load_built(build_dir: Path, name: str) -> Path | None:
    """The already built library of this source hash, loaded into torch.ops (None if not built)."""
    so = build_dir / f"{name}.so"
    if not so.is_file() or (build_dir / "lock").exists():
        return None
    torch.ops.load_library(str(so))
    return so


def _build(build_dir: Path, name: str) -> None:
    """Compile the library into `build_dir` (ninja, or wait for another process's build) and load it,
    with one line to stderr before and one after (the first run of an install waits minutes here)."""
    from torch.utils.cpp_extension import load

    print(f"kvshare: building the native kernels in {build_dir} (once per install and torch version; a few minutes)...",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        load(name=name, sources=[str(CSRC / s) for s in SOURCES], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS,
             extra_include_paths=[str(CSRC)], build_directory=str(build_dir), verbose=False, is_python_module=False)
    except Exception:
        print(f"kvshare: native kernel build failed after {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        raise
    print(f"kvshare: native kernels built in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)


def _clear_stale_lock(build_dir: Path) -> None:
    """Remove a build lock left by a killed build: torch's loader would otherwise wait for ever."""
    lock = build_dir / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            log.warning("kvshare kernels: removing a stale build lock %s", lock)
            lock.unlink()
    except FileNotFoundError:
        pass


@lru_cache(maxsize=1)
def library() -> Any:
    """``torch.ops.kvshare`` once the library is built (first call) and loaded, its fake implementations
    registered; None (after one warning) when it cannot be built."""
    if os.environ.get("KVSHARE_KERNELS", "").lower() in ("off", "0", "torch"):
        return None
    try:
        key = source_hash()
        name = f"kvshare_kernels_{key}"
        build_dir = cache_root() / f"torch{torch.__version__.replace('+', '_')}-{key}"
        build_dir.mkdir(parents=True, exist_ok=True)
        if _load_built(build_dir, name) is None:  # built before: no ninja run, no build lock to wait on
            _clear_stale_lock(build_dir)
            _build(build_dir, name)
        from kvshare.kernels import fake_ops

        fake_ops.register()
        return torch.ops.kvshare
    except Exception as e:  # no compiler, no ninja, a compile error: run the torch path
        log.warning("kvshare kernels: native library unavailable (%s: %s); using the pure-torch path",
                    type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None


@torch.compiler.assume_constant_result  # traced code takes the answer (Dynamo would trace the build and its hashing)
def loaded() -> bool:
    """Whether the library is built and loaded (`library()` is not None)."""
    return library() is not None


@torch.compiler.assume_constant_result  # (Dynamo traces through an lru_cache, so the mark sits on this function)
def best_isa() -> str:
    """The code path used by default (see module doc): "amx", "avx512", "avx2" or "torch"."""
    return _best_isa()


@lru_cache(maxsize=1)
def _best_isa() -> str:
    lib = library()
    if lib is None:
        return "torch"
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if cap == "default":
        return "torch"
    if cap != "avx2" and lib.cpu_has("amx"):
        return "amx"
    if cap != "avx2" and lib.cpu_has("avx512bf16"):
        return "avx512"
    if lib.cpu_has("avx2"):
        return "avx2"
    log.warning("kvshare kernels: CPU has neither AVX-512 BF16 nor AVX2+FMA; using the pure-torch path")
    return "torch"


best_isa.cache_clear = _best_isa.cache_clear  # type: ignore[attr-defined]


def supported_isas() -> list[str]:
    """Every code path this machine can run (for tests comparing them), best first."""
    lib = library()
    pairs = (("amx", "amx"), ("avx512", "avx512bf16"), ("avx2", "avx2"))
    out = [] if lib is None else [i for i, f in pairs if lib.cpu_has(f)]
    return out + ["torch"]
