"""The native ops, each resolved once to its one overload: ``ops.<name>`` is
``torch.ops.kvshare.<name>.default``.

Calling the overload instead of the packet (``torch.ops.kvshare.<name>``) skips the packet's
per-call overload resolution; a decode step makes ~70 such calls (measured in one process on the
bench's peer model: ~2% of a batch-1 step). The first use of a name resolves it (the library must be
loaded: `kernels.build.library`); later uses are a plain attribute read.
"""

from __future__ import annotations

from typing import Any

import torch


class _Ops:
    """``ops.<name>``: the op's default overload, resolved on first use and kept as an attribute."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        op = getattr(torch.ops.kvshare, name).default
        setattr(self, name, op)
        return op


ops = _Ops()
