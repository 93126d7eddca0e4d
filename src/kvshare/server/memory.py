"""The process's resident memory, and handing freed heap memory back to the OS.

glibc's malloc keeps freed memory in its arenas (one per thread that allocated) instead of
returning it: after a burst of large requests the server's RSS stays at its peak although the
Python objects are gone. `release_free_memory()` calls glibc's `malloc_trim(0)`, which returns
the free pages of every arena; on another C library it does nothing and says so (False).
`rss_bytes()` reads the resident set size from /proc (None where there is no /proc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from typing import Any


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name)
        lib.malloc_trim.argtypes = [ctypes.c_size_t]
        lib.malloc_trim.restype = ctypes.c_int
        return lib
    except (OSError, AttributeError):  # not glibc: no malloc_trim
        return None


def release_free_memory() -> bool:
    """Return the C heap's free pages to the OS (glibc `malloc_trim(0)`); False where unsupported."""
    lib = _libc()
    if lib is None:
        return False
    lib.malloc_trim(0)
    return True


def rss_bytes(pid: int | str = "self") -> int | None:
    """Resident set size of process `pid` (default: this one) in bytes, from /proc; None without /proc."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
