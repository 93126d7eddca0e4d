"""Timing, memory and bandwidth primitives shared by every benchmark section.

* ``PeakMemory``: peak resident memory of a code region. On Linux it resets the kernel's
  high-water mark (``/proc/self/clear_refs`` = 5) and reads ``VmHWM`` afterwards, so each region
  is measured on its own inside one process; freed heap is first handed back with
  ``malloc_trim`` so an earlier region's garbage does not hide a later one's growth. On CUDA it
  also reports ``torch.cuda.max_memory_allocated``.
* ``sync`` / ``now``: a device-synchronising clock.
* ``copy_bandwidth``: the machine's measured memory bandwidth (a large tensor copy);
  ``read_bandwidth``: a read-only stream (a large tensor's sum).
* ``load_note``: the 1-minute load average and core count, printed next to every result because
  other processes share this machine's cores.
"""

from __future__ import annotations

import ctypes
import os
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def sync(device: torch.device | str | None = None) -> None:
    """Wait for queued device work (a no-op on CPU)."""
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda":
        torch.cuda.synchronize(dev)


def now(device: torch.device | str | None = None) -> float:
    """`time.perf_counter()` after the device has finished its queued work."""
    sync(device)
    return time.perf_counter()


def _status_kib(key: str) -> int | None:
    try:
        m = re.search(rf"^{key}:\s+(\d+)\s+kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def malloc_trim() -> None:
    """Return freed heap pages to the OS (glibc only; silently skipped elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss_bytes() -> int:
    """Current resident set size in bytes (0 when unknown)."""
    kib = _status_kib("VmRSS")
    return (kib or 0) * 1024


@dataclass
class PeakMemory:
    """Context manager measuring the peak memory of the region it wraps.

    ``peak_rss``: the process's peak RSS during the region (bytes); ``base_rss``: RSS on entry;
    ``delta_rss`` = peak - base: what the region added at its worst. ``cuda_peak``: peak bytes
    allocated by torch on the CUDA device (None on CPU). ``method`` says how RSS was measured.
    """

    device: torch.device | str = "cpu"
    base_rss: int = 0
    peak_rss: int = 0
    cuda_peak: int | None = None
    method: str = "VmHWM"

    def __enter__(self) -> "PeakMemory":
        import gc

        gc.collect()
        malloc_trim()
        dev = torch.device(self.device)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        try:
            _CLEAR_REFS.write_text("5")
        except OSError:
            self.method = "VmRSS (peak reset unavailable)"
        self.base_rss = rss_bytes()
        return self

    def __exit__(self, *exc: Any) -> None:
        dev = torch.device(self.device)
        if dev.type == "cuda":
            sync(dev)
            self.cuda_peak = int(torch.cuda.max_memory_allocated(dev))
        hwm = _status_kib("VmHWM")
        self.peak_rss = max((hwm or 0) * 1024, rss_bytes())

    @property
    def delta_rss(self) -> int:
        return max(0, self.peak_rss - self.base_rss)

    def as_dict(self) -> dict[str, Any]:
        return {"peak_rss": self.peak_rss, "base_rss": self.base_rss, "delta_rss": self.delta_rss,
                "cuda_peak": self.cuda_peak, "method": self.method}


@dataclass
class StepTimes:
    """Wall times of repeated steps; summaries use the median (robust to a noisy shared machine)."""

    seconds: list[float] = field(default_factory=list)

    def add(self, s: float) -> None:
        self.seconds.append(s)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds) if self.seconds else float("nan")

    @property
    def mean(self) -> float:
        return statistics.fmean(self.seconds) if self.seconds else float("nan")

    def as_dict(self) -> dict[str, Any]:
        s = self.seconds
        return {"n": len(s), "median_s": self.median, "mean_s": self.mean,
                "min_s": min(s) if s else None, "max_s": max(s) if s else None}


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 5, device: torch.device | str = "cpu") -> dict[str, float]:
    """Measured copy bandwidth: best of `repeats` copies of an `nbytes` float32 tensor.

    Reports ``read_write_gbps`` (bytes read + bytes written per second, the convention used for
    the achieved-bandwidth numbers, which count bytes read) and ``read_gbps`` (half of it).
    """
    n = max(1, nbytes // 4)
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        t0 = now(device)
        dst.copy_(src)
        best = min(best, now(device) - t0)
    moved = 2 * n * 4
    del src, dst
    malloc_trim()
    return {"bytes": float(n * 4), "seconds": best, "read_write_gbps": moved / best / 1e9,
            "read_gbps": moved / 2 / best / 1e9}


def read_bandwidth(nbytes: int = 1 << 29, repeats: int = 5) -> float:
    """Measured read-only bandwidth in GB/s: best of `repeats` sums of an `nbytes` float32 tensor on
    the CPU (torch's intra-op threads). A stream that only reads runs faster than half a copy (no
    writes), so this is the ceiling a decode step's weight reads can approach."""
    x = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    x.sum()  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    size = x.numel() * 4
    del x
    malloc_trim()
    return size / best / 1e9


def load_note() -> dict[str, Any]:
    """The machine's load (1/5/15-minute averages), core count and torch thread count."""
    try:
        l1, l5, l15 = os.getloadavg()
    except OSError:
        l1 = l5 = l15 = float("nan")
    return {"loadavg_1m": round(l1, 2), "loadavg_5m": round(l5, 2), "loadavg_15m": round(l15, 2),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}


def package_version(pkg: str) -> str:
    """The installed version of distribution `pkg`, or "not installed" (for a report's header)."""
    import importlib.metadata as md

    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return "not installed"
