"""Count torch calls and host syncs of a piece of code with a TorchFunctionMode.

A *host sync* is a call whose result the host must wait for on an accelerator: reading a tensor's
value into Python (``item``, ``tolist``, ``bool(t)``, ``int(t)``, ``float(t)``, ``t.__index__``),
comparing contents (``torch.equal``), and ops whose output shape depends on the data (``nonzero``,
``argwhere``, ``masked_select``, ``unique``, ``bincount``, ``repeat_interleave`` without
``output_size``, indexing or assigning with a boolean mask). ``numpy()`` is not one: it exists
only for CPU tensors, so code calling it is a CPU-only branch (mHC's Sinkhorn on the CPU).
Every call that reaches ``__torch_function__`` (ops, methods, attribute reads such as ``.shape``)
counts as a torch call, except kvshare's own native kernels (``torch.ops.kvshare.*``), counted apart
as ``native`` (they were invisible to the mode before they were torch ops, and the bounds written
against these counts are about the Python-side torch calls around them). Each sync is also counted by the kvshare module that made it (``sites``).
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_VALUE_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "equal"}
_DATA_SHAPED = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount"}


def _bool_index(idx: Any) -> bool:
    items = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def is_host_sync(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a call named `name` with these arguments makes the host wait for the device."""
    if name in _VALUE_READS or name in _DATA_SHAPED:
        return True
    if name == "repeat_interleave":
        return "output_size" not in kwargs and len(args) > 1 and isinstance(args[1], torch.Tensor)
    if name in ("__getitem__", "__setitem__", "index_put_", "index_put"):
        return len(args) > 1 and _bool_index(args[1])
    return False


class CallCounter(TorchFunctionMode):
    """``with CallCounter() as c: ...``: ``c.calls`` torch calls, ``c.syncs`` host syncs (by name in
    ``c.sync_names``)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.native = 0  # torch.ops.kvshare.* calls (see module doc)
        self.syncs = 0
        self.sync_names: Counter[str] = Counter()
        self.names: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()  # kvshare module (e.g. "model/moe.py") -> host syncs

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if str(getattr(func, "_qualified_op_name", getattr(func, "namespace", ""))).startswith("kvshare"):
            self.native += 1
            return func(*args, **kwargs)
        self.calls += 1
        self.names[name] += 1
        if is_host_sync(name, args, kwargs):
            self.syncs += 1
            self.sync_names[name] += 1
            self.sites[_caller()] += 1
        return func(*args, **kwargs)


def _caller() -> str:
    """The kvshare module (path under kvshare/) of the innermost kvshare frame on the stack."""
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename.replace("\\", "/")
        if "/kvshare/" in path and "/site-packages/torch/" not in path:
            return path.rsplit("/kvshare/", 1)[1]
        f = f.f_back
    return "?"
