"""Which parameters a bf16 (or fp16) model keeps in fp32, and the cast that applies it.

The reference (spec/model.md §1.3 "Storage / compute dtypes") keeps these in fp32 while the
projection weights are bf16; kvshare does the same whenever the model dtype is narrower than fp32:

* every RMSNorm weight (`*_norm.weight`, `norm.weight`, compressor norms);
* the mHC parameters `hc_{attn,ffn,head}_{fn,base,scale}`;
* the MoE router `ffn.gate.{weight,bias}`;
* the per-head `attn_sink`; V4's compressor `ape`;
* ratio > 1 compressor projections `compressor.{wkv,wgate}`: stored bf16 by the checkpoint and
  promoted to fp32 by the reference, so kvshare rounds them to bf16 once and keeps that value in
  fp32 (exact), instead of converting on every call.

For fp32 and float64 models every parameter simply takes the model dtype (the oracle modes).
After the cast, bf16 `Linear` weights on the CPU are packed once for oneDNN (`pack_linears`).
"""

from __future__ import annotations

import torch
from torch import nn

from kvshare.model.compressor import Compressor
from kvshare.layers.linear import Linear, pack_linears
from kvshare.model.moe import Gate
from kvshare.layers.norm import RMSNorm

_FP32_LEAVES = ("attn_sink", "ape")


def _keeps_fp32(module: nn.Module, leaf: str) -> bool:
    if isinstance(module, (RMSNorm, Gate)):
        return True
    return leaf in _FP32_LEAVES or leaf.startswith("hc_")


def cast_model(model: nn.Module, dtype: torch.dtype, device: torch.device | str | None = None) -> nn.Module:
    """Move `model` to `device` and `dtype` in place, keeping the fp32 set above when `dtype` is
    narrower than fp32; bf16 CPU linears are then packed. Returns `model`."""
    if device is not None:
        model.to(device=device)
    narrow = dtype.itemsize < 4
    promoted: set[int] = set()
    if narrow:
        for module in model.modules():
            if isinstance(module, Compressor) and module.ratio > 1:
                promoted |= {id(module.wkv.weight), id(module.wgate.weight)}
    with torch.no_grad():
        for module in model.modules():
            for leaf, p in module.named_parameters(recurse=False):
                if id(p) in promoted:
                    rounded = p.data.to(dtype).to(torch.float32)
                    if not (p.dtype == torch.float32 and torch.equal(rounded, p.data)):
                        p.data = rounded  # (already rounded: the same storage, so packs made of it stay valid)
                elif narrow and _keeps_fp32(module, leaf):
                    p.data = p.data.to(torch.float32)
                else:
                    p.data = p.data.to(dtype)
            for name, b in module.named_buffers(recurse=False):
                if b.is_floating_point():
                    setattr(module, name, b.to(torch.float32 if narrow else dtype))
    pack_linears(model)
    from kvshare.model.deepseek import Transformer  # (deepseek imports this module's neighbours)

    if isinstance(model, Transformer):
        model.bind(model.kernels)  # the layers' choices depend on the weights' dtypes
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights in memory: every parameter as stored, plus the FP8 / FP4 weights that
    `Linear`s hold packed (their checkpoint bytes; speed copies such as oneDNN's are not counted)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params + sum(m.qweight.nbytes for m in model.modules() if isinstance(m, Linear) and m.qweight is not None)

