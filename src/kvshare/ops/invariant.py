"""Batch-invariant products: a row's bits depend on that row alone (issue 24).

CPU GEMM libraries pick their kernel, blocking and so the reduction order by the call's shape: the
same row multiplied by the same weight gives different fp32 bits in calls of 1, 2-9 and >= 16 rows
(MKL on an AMX Xeon), and bf16 oneDNN differs too at K = 4096. So a token's logits used to depend
on how many other rows shared its step (batching, chunking, speculative verify rows).

The batch-invariant model routes every product whose reduction crosses a row's own values
through one of these functions, each of which computes row r from row r's inputs with a call whose
shape does not depend on the other rows:

* `row_linear(x, w)`: ``x @ w.T`` for x [R, K]. One fixed-order kernel call when the native
  kernels are present (`kvshare.kernels`: each output accumulated in an order that depends on K
  only), else one identical [1, K] x [K, N] product per row.
* per-row batched products (attention, index scores): ``torch.bmm`` with one row per batch entry
  and a per-entry shape fixed by the row itself; torch computes every entry of a batched product
  with the same per-entry kernel, whatever the batch count.
* length buckets (`StepAddresses.length_buckets(ratio, BUCKET)`, from the step's host ints): per-row
  key counts rounded up to a multiple of `BUCKET`, so rows whose own counts fall in one bucket share
  one product shape, and a row's shape never depends on another row's count.

* `pointwise(fn, x)`: torch's vectorised element-wise kernels compute a tensor's last
  ``numel % (2 x vector width)`` elements in a scalar loop, and its scalar sigmoid, softplus and silu
  differ from the vector ones in the last bit (measured: 90 / 195 / 85 of 2,000 fp32 values), so a
  row's gate or mHC weights changed with the number of rows behind it. Padding the flat tensor to a
  multiple of `VECTOR_PAD` elements sends every element through the vector loop.

Row-wise reductions over a fixed length (norms, softmax over a row, top-k), gathers and correctly
rounded element-wise ops (+, *, /, sqrt, and exp / rsqrt / log, whose two paths agree) need nothing.
Single-threaded element-wise kernels are assumed (the engine pins 1 intra-op thread for small
models; torch splits element-wise work across threads only above 32,768 elements).
"""

from __future__ import annotations


import torch

from kvshare import kernels
from kvshare.kernels import fallback
from kvshare.precision import version_of

#: rows of keys per length bucket (index scores, V4's every-entry compressed attention)
BUCKET = 64
#: element-wise ops see tensors padded to a multiple of this many elements (see `pointwise`)
VECTOR_PAD = 64

_MAX_PACKS_PER_WEIGHT = 16  # a weight's packed views (wo_a's groups) and versions kept at once


def matmul_t(x: torch.Tensor, w: torch.Tensor, invariant: bool) -> torch.Tensor:
    """``x @ w.T``: `row_linear` for a batch-invariant caller (`invariant`), else the plain product."""
    return row_linear(x, w) if invariant else x @ w.t()


def native_pack(w: torch.Tensor):
    """The kernels' packed copy of weight `w` (made once per weight version for parameters and
    their views; per call for other tensors), or None where the kernels do not serve it (no native
    library, a dtype other than bf16 / fp32, not on the CPU)."""
    own = w.__dict__.get("_kvshare_own") if isinstance(w, torch.nn.Parameter) else None
    if own is not None:  # a parameter's own pack: two reads instead of the general key below
        try:
            version = w._version
        except RuntimeError:  # an inference tensor has no version counter (`version_of`)
            version = -1
        # (address, version) names the data: a replaced ``.data`` is a new storage, allocated
        # while the old one is alive, so at another address (and its dtype goes with it)
        if own[0] == (w.data_ptr(), version):
            return own[1]
    if not kernels.available() or w.dtype not in (torch.bfloat16, torch.float32) or w.device.type != "cpu":
        return None
    root = w._base if w._base is not None else w
    if not isinstance(root, torch.nn.Parameter):
        # a temporary (e.g. ``wide(bf16 weight)``): its address is reused by later temporaries of
        # the same shape, so a cached pack would be stale; pack it for this call only
        return kernels.pack(w.detach().contiguous())
    # kept on the parameter object itself, so a pack dies with its weight (an address-keyed cache
    # could hand a later model's weight at a reused address the earlier model's pack)
    packs = root.__dict__.setdefault("_kvshare_packs", {})
    # the address too: a replaced ``.data`` starts a new version counter at 0, so (offset, version)
    # alone would hand back the first weight's pack
    key = (w.data_ptr(), w.dtype, tuple(w.shape), tuple(w.stride()), version_of(w))
    p = packs.get(key)
    if p is None:
        if len(packs) >= _MAX_PACKS_PER_WEIGHT:
            packs.clear()
        p = packs[key] = kernels.pack(w.detach().contiguous())
    if root is w:
        w.__dict__["_kvshare_own"] = ((key[0], key[-1]), p)
    return p


def row_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` ([..., K] x [N, K] -> [..., N]) with each row's bits independent of the other rows."""
    packed = native_pack(w)
    if packed is not None and x.dtype == packed.act_dtype:  # (a pack's act_dtype is its weight's dtype)
        return kernels.linear_checked(x, packed)
    flat = x.dim() == 2  # the common case: no reshapes (each a torch call)
    x2 = x if flat else x.reshape(-1, x.shape[-1])
    out = fallback.rows(x2, w)
    return out if flat else out.reshape(*x.shape[:-1], w.shape[0])


def pointwise(fn, x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """``fn(x)`` for an element-wise `fn`; for a batch-invariant caller (`invariant`) every element
    takes torch's vector loop (x flattened and padded to a multiple of VECTOR_PAD; see module doc)."""
    if not invariant:
        return fn(x)
    flat = x.reshape(-1)
    n = flat.numel()
    pad = -n % VECTOR_PAD
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return fn(flat)[:n].view(x.shape)
