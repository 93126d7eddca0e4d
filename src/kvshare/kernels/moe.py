"""A MoE layer's experts in one native call (csrc/moe.cpp), with the layer's packs collected once.

`experts(x, ids, weights, packs, ...)` computes what `model/moe.py`'s torch + per-expert-kernel
path computes after the gate, bitwise: the slots grouped per expert (stable), each group's w1 / w3 GEMMs, the
clamped SwiGLU times the routing weight, the FP8 rounding of the GEMM inputs where the model has
it, the w2 GEMM, and the per-token combine (slots j = 0..k-1 in torch's order, then the shared
expert). The GEMMs are the same C++ functions `kernels.linear` calls, with its ISA (`best_isa`),
padding and thread split; the SwiGLU, combine and FP8 rounding are `kernels.decode`'s. No host
read in Python, no per-expert Python: one call per layer.

**The pack set** (`LayerPacks`, `pack_set`; `model/moe.py` keeps it on the MoE module): every routed
expert's and the shared expert's w1 / w3 / w2 in kernel layout (an FP8 / FP4 checkpoint weight's
own `Packed`, else `ops.invariant.native_pack` of the dense weight), built on first use. It is
stale when

* a watched tensor (each dense weight, each packed weight's data) has another address, dtype or
  in-place version than at build time: checked in C++ on every call (the registered set's stamps,
  `kernels.pack_sets`);
* a parameter or submodule was registered anywhere since the build (`pack_memo.generation`): a
  replaced ``weight`` Parameter, `Linear.set_packed`, a replaced expert.

The caller (`model/moe.py`) runs the torch path where the call does not apply (native decode
kernels off, a weight the kernels do not serve, an activation dtype the packs do not take).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvshare.kernels.build import best_isa, loaded
from kvshare.kernels.pack_memo import generation
from kvshare.kernels.pack_sets import RegisteredSet
from kvshare.kernels.packed import FORMAT_ID, Packed
from kvshare.kernels.ops import ops


@dataclass(eq=False)
class LayerPacks:
    """The packed weights of one MoE layer (module doc) and what they are valid for."""

    registered: RegisteredSet  # data, exps of linear l = 3 e + (w1, w3, w2) (e = E: the shared expert),
    # meta int64 [3 (E + 1), 6] (fmt, n, k, kp, block, group_exps), the watched weights
    act_dtype: torch.dtype
    generation: int


def pack_set(linears: list[tuple[Packed, torch.Tensor]]) -> LayerPacks | None:
    """The pack set of a layer from (pack, watched tensor) per linear, in the order of `LayerPacks.tensors`
    (w1, w3, w2 of experts 0..E-1, then of the shared expert); None without the native library or
    when the packs take different activation dtypes."""
    if not loaded() or len(linears) % 3 or len(linears) < 6:
        return None
    tensors, meta = [], []
    for p, _ in linears:
        tensors += [p.data, p.exps]
        meta.append([FORMAT_ID[p.fmt], p.n, p.k, p.kp, p.block, int(p.fmt == "fp8" and p.exps.dim() == 2)])
    dtypes = {p.act_dtype for p, _ in linears}
    if len(dtypes) != 1:
        return None
    watch = [w for _, w in linears]
    return LayerPacks(RegisteredSet(tensors, torch.tensor(meta, dtype=torch.int64), watch), dtypes.pop(), generation())


def fresh(packs: LayerPacks | None) -> bool:
    """Whether no parameter or submodule was registered anywhere since `packs` was built (the C++
    call checks the watched tensors themselves)."""
    return packs is not None and packs.generation == generation()


def experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, packs: LayerPacks, limit: float,
            x_block: int, h_block: int) -> torch.Tensor | None:
    """[T, D] in x's dtype: the routed + shared experts for tokens x [T, D] (bf16 / fp32, `packs.act_dtype`)
    routed to ids [T, k] (int64) with weights [T, k] (fp32), bitwise the torch path's (module doc).
    `x_block` / `h_block`: FP8 blocks of the w1 / w3 and the w2 inputs (0: no rounding). None when
    a watched weight changed since `packs` was built (rebuild them and call again)."""
    out = ops.moe_experts(x.contiguous(), ids.contiguous(), weights.contiguous(), packs.registered.id,
                          float(limit), x_block, h_block, best_isa())
    return out[0] if out else None
