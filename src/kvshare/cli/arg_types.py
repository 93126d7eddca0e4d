"""argparse value types shared by the subcommands."""

from __future__ import annotations

import argparse
import re
from typing import Any, Callable

# Bare k/m/g/t and KiB/MiB/GiB/TiB are binary; kB/MB/GB/TB are decimal.
_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """'80GiB', '512MiB', '1e9', '80GB' (decimal), '4G' (binary) -> bytes (a positive int)."""
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"invalid memory size {text!r}: use a number with an optional unit, e.g. 80GiB, 512MiB, 1e9, 40GB")
    value = float(m.group(1)) * _UNITS[unit]
    if not value >= 1 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"invalid memory size {text!r}: must be at least 1 byte")
    return int(value)


def _checked(text: str, cast: type, ok: Callable[[float], bool], wanted: str, bad_range: str) -> Any:
    """`cast(text)` when it parses and `ok` holds; argparse's error otherwise."""
    try:
        v = cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
    if not ok(v):
        raise argparse.ArgumentTypeError(bad_range.format(text=text, v=v))
    return v


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _checked(text, int, lambda v: v > 0, "a positive integer", "expected a positive integer, got {text!r}")


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds)."""
    return _checked(text, float, lambda v: 0 < v < float("inf"), "a positive number",
                    "expected a positive number, got {text!r}")


def port_number(text: str) -> int:
    """A TCP port, 1-65535 (0 is refused: clients need to know the port)."""
    return _checked(text, int, lambda v: 1 <= v <= 65535, "a TCP port number", "a TCP port is 1-65535, got {v}")
