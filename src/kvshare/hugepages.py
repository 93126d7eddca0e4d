"""The CLI's process on transparent huge pages: glibc's ``malloc.hugetlb`` tunable, set at startup.

A decode step streams ~85 MB of weights (the bench's peer model) through the caches and the TLB
between ~70 kernel calls, and every Python and torch operation in between then misses the TLB on
its own data. With glibc's ``glibc.malloc.hugetlb=1`` tunable (glibc 2.35+) malloc asks the kernel
for 2 MiB pages (``madvise(MADV_HUGEPAGE)``) on the heap and its large mappings, so the tensors,
torch's and the interpreter's malloc'd state take a few hundred page translations instead of
~100,000. Measured on the bench's peer model (batch-1 decode, one thread, alternating runs): 9.9-10.1
ms per step without it, 8.5-9.9 ms with it; every engine in the process gains (the bench's
transformers and llama.cpp runs too).

glibc reads its tunables only when a process starts, so `reexec_if_wanted` (called first by
``kvshare``'s command line) restarts the process once with the tunable added to ``GLIBC_TUNABLES``:
on Linux, where the kernel offers THP (``/sys/kernel/mm/transparent_hugepage/enabled`` is
``always`` or ``madvise``) and glibc is 2.35 or newer, unless ``KVSHARE_HUGEPAGES=off`` or the
tunable is already set. The same process id, arguments and environment otherwise. A program that
imports kvshare as a library sets ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` itself if it wants this.
"""

from __future__ import annotations

import os
import sys

TUNABLE = "glibc.malloc.hugetlb"
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def _glibc_at_least(major: int, minor: int) -> bool:
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # e.g. "glibc 2.36"
        have = tuple(int(p) for p in version.split(".")[:2])
    except (AttributeError, ValueError, OSError):
        return False
    return name == "glibc" and have >= (major, minor)


def _thp_offered() -> bool:
    try:
        with open(_THP_SETTING) as f:
            mode = f.read()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def wanted(environ: dict[str, str] | None = None) -> bool:
    """Whether `reexec_if_wanted` would restart the process (module doc)."""
    env = os.environ if environ is None else environ
    if env.get("KVSHARE_HUGEPAGES", "").lower() in ("off", "0", "no"):
        return False
    if TUNABLE in env.get("GLIBC_TUNABLES", ""):
        return False
    return sys.platform.startswith("linux") and _glibc_at_least(2, 35) and _thp_offered()


def with_tunable(environ: dict[str, str]) -> dict[str, str]:
    """A copy of `environ` with ``glibc.malloc.hugetlb=1`` added to its ``GLIBC_TUNABLES``."""
    env = dict(environ)
    prior = env.get("GLIBC_TUNABLES", "")
    env["GLIBC_TUNABLES"] = f"{prior}:{TUNABLE}=1" if prior else f"{TUNABLE}=1"
    return env


def reexec_if_wanted(argv: list[str]) -> None:
    """Restart this process as ``python -m kvshare *argv`` with the tunable set, where `wanted`;
    returns (doing nothing) otherwise, or if the restart fails."""
    if not wanted():
        return
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", "kvshare", *argv], with_tunable(dict(os.environ)))
    except OSError:
        return
