"""An attention layer's projections through the fused native calls (`kernels.attn_proj`), where they serve.

`project_in` (for `Attention.forward`) and `project_out` (for `Attention.project_out`) return the
fused calls' results, or None where the torch composition must run: outside a batch-invariant
forward (the batched mode's products are oneDNN's, other bits), with autograd recording, without
the native kernels or with ``KVSHARE_NATIVE_ATTN_PROJ=off``, for an activation dtype the packs do
not take, when a module involved has a forward hook (tensor parallelism sums ``wo_b``'s output in
one), or where the torch path would not take its native kernels itself (rows under 8 values:
torch's RMSNorm; a ``wo_a`` kept FP8-packed; float64 weights).

A bf16 norm weight is used as an fp32 copy (made with the pack set): the torch path computes
``(rms_normalize(x) * wide(w)).to(dtype)`` for it, the same fp32 products as the native RMSNorm
with an fp32 weight, so the same bits.

Invariant: where these return a result, it has the torch path's bits (the kernels compose the same
GEMM, RMSNorm, RoPE and FP8 rounding functions the torch path reaches in that mode).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvshare.kernels import attn_proj
from kvshare.kernels import decode as native
from kvshare.kernels.pack_memo import per_generation
from kvshare.kernels.packed import Packed
from kvshare.model.linear import Linear
from kvshare.model.quantize import QuantMode, fit_block
from kvshare.ops import invariant

if TYPE_CHECKING:
    from kvshare.model.attention import Attention
    from kvshare.model.rope import RotaryEmbedding

_GLOBAL_HOOKS = (nn.modules.module._global_forward_hooks, nn.modules.module._global_forward_pre_hooks)


@dataclass(eq=False)
class Fused:
    """A layer's pack set and what a call needs besides it (kept on the module, see `fused_of`)."""

    packs: attn_proj.ProjPacks
    norms: tuple[torch.Tensor, torch.Tensor]  # q_norm, kv_norm weights in fp32 (the parameters when fp32)
    mode: QuantMode
    blocks: tuple[int, int, int]  # FP8 blocks of x (wq_a, wkv), qr (wq_b), u (wo_b) when mode.act
    head_norm: bool  # V4: q is RMS-normalised per head
    in_hooks: tuple[dict, ...]  # forward (pre-)hook dicts of the modules attn_in stands for
    out_hooks: tuple[dict, ...]


def hooked(hooks: tuple[dict, ...]) -> bool:
    """Whether any of the hook dicts (`hook_dicts`) or torch's global module hooks holds a hook."""
    return any(hooks) or any(_GLOBAL_HOOKS)


def serves(x: torch.Tensor) -> bool:
    """Whether a fused projection may take x: a batch-invariant native forward without autograd."""
    return invariant.is_on() and attn_proj.enabled() and native.serves(x) and not torch.is_grad_enabled()


def project_in(attn: "Attention", x: torch.Tensor, pos: torch.Tensor, rope: "RotaryEmbedding"
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(qr, q [T, H, d] normed (V4) and rotated, kv [T, d] normed and rotated) for x [T, D], or None."""
    if not serves(x) or x.dim() != 2 or pos.dim() != 1:
        return None
    for _ in range(2):  # a pack set found stale in C++ is rebuilt once
        f = fused_of(attn)
        if f is None or x.dtype != f.packs.act_dtype or hooked(f.in_hooks):
            return None
        c, s, _ = rope.native_tables(pos)
        xb, qb, _ = f.blocks if f.mode.act else (0, 0, 0)
        out = attn_proj.attn_in(x, f.packs, f.norms[0], f.norms[1], attn.q_norm.eps, c, s, attn.n_heads, f.head_norm,
                                xb, qb)
        if out is not None:
            return out
        attn.__dict__.pop("_native_proj", None)
    return None


def project_out(attn: "Attention", o: torch.Tensor, pos: torch.Tensor, rope: "RotaryEmbedding") -> torch.Tensor | None:
    """[T, D] from the attention output o [T, H, d] (rotated back in place, as the torch path does), or None."""
    if not serves(o) or o.dim() != 3 or not o.is_contiguous() or pos.dim() != 1:
        return None
    for _ in range(2):
        f = fused_of(attn)
        if f is None or o.dtype != f.packs.act_dtype or hooked(f.out_hooks):
            return None
        c, _, s_neg = rope.native_tables(pos)
        y = attn_proj.attn_out(o, f.packs, c, s_neg, f.blocks[2] if f.mode.act else 0)
        if y is not None:
            return y
        attn.__dict__.pop("_native_proj", None)
    return None


def fused_of(attn: "Attention") -> Fused | None:
    """The layer's `Fused`, or None where the fused calls do not serve this layer; built once per
    registration generation (`kernels.moe.generation`: a replaced parameter or submodule anywhere)
    and kept on the module with it, the negative answer too."""
    return per_generation(attn, "_native_proj", lambda: _build(attn))


def pack_of(lin: Linear, w: torch.Tensor | None = None) -> tuple[Packed, torch.Tensor] | None:
    """(pack, watched tensor) of a linear (or of `w`, a view of its weight) as the torch path uses
    it: the FP8 / FP4 checkpoint pack, else `invariant.native_pack`; None when it has neither."""
    if w is None and lin.qweight is not None:
        return lin.qweight, lin.qweight.data
    p = invariant.native_pack(lin.weight if w is None else w)
    return None if p is None else (p, lin.weight)


def hook_dicts(*mods: nn.Module) -> tuple[dict, ...]:
    """The forward and forward-pre hook dicts of `mods` (a fused call stands for their forwards)."""
    return tuple(d for m in mods for d in (m._forward_hooks, m._forward_pre_hooks))


def _build(attn: "Attention") -> Fused | None:
    """The layer's `Fused` from its current weights, or None where the fused calls cannot give the
    torch path's bits (see the module doc)."""
    cfg, g = attn.cfg, attn.n_groups
    qlin = (attn.wq_a, attn.wq_b, attn.wkv, attn.wo_b)
    norms = (attn.q_norm, attn.kv_norm)
    if (attn.wo_a.qweight is not None or any(q.mode is not attn.wq_a.mode for q in qlin)
            or attn.wq_a.block != attn.wkv.block or g < 1
            or any(n.weight.dtype not in (torch.float32, torch.bfloat16) or n.eps != cfg.rms_norm_eps for n in norms)
            or min(attn.head_dim, attn.wq_a.out_features) < 8):  # narrower rows: torch's own RMSNorm
        return None
    wo_a = attn.wo_a.weight.view(g, cfg.o_lora_rank, -1)  # the torch path's group views (their packs)
    got = [pack_of(attn.wq_a), pack_of(attn.wq_b), pack_of(attn.wkv),
           *(pack_of(attn.wo_a, wo_a[i]) for i in range(g)), pack_of(attn.wo_b)]
    if any(x is None for x in got):
        return None
    packs = attn_proj.pack_set([p for p, _ in got], [w for _, w in got] + [n.weight for n in norms])
    if packs is None:
        return None
    blocks = (fit_block(attn.wq_a.in_features, attn.wq_a.block), fit_block(attn.wq_b.in_features, attn.wq_b.block),
              fit_block(attn.wo_b.in_features, attn.wo_b.block))
    with torch.no_grad():
        norm32 = tuple(n.weight.detach().float() for n in norms)
    return Fused(packs, norm32, attn.wq_a.mode, blocks, cfg.arch == "v4",
                 hook_dicts(attn.wq_a, attn.q_norm, attn.wq_b, attn.wkv, attn.kv_norm),
                 hook_dicts(attn.wo_a, attn.wo_b))
