"""Attention's input and output projections (spec/model.md §4.3, §4.4, §4.7), bound once: `AttnIn`, `AttnOut`.

`AttnIn(x, pos, rope)` -> (qr, q, kv): ``qr = q_norm(wq_a(x))``, ``q = RoPE((V4: per-head RMSNorm
of) wq_b(qr))``, ``kv = RoPE(kv_norm(wkv(x)))``. `AttnOut(o, pos, rope)` -> [T, D]: the inverse RoPE
of o (in place), each group's ``wo_a`` product, then ``wo_b``. Both layers hold no parameters: they
read their attention layer's (``wq_a`` ... ``wo_b`` keep their checkpoint names there).

Implementations (picked by `select` from the `KernelChoice`):
* ``forward_torch``: the torch composition (the reference; batched grouped ``wo_a`` product);
* ``forward_invariant`` (`AttnOut`): each group's ``wo_a`` product row-invariant
  (`ops.invariant.row_linear`); `AttnIn`'s torch composition is already the modules' own;
* ``forward_native`` (a batch-invariant model with ``fused_attn_proj``): one native call each
  (`kernels.attn_proj`), the same bits as the batch-invariant torch composition by construction.
  Where a call does not serve (``fused`` returns None) the batch-invariant torch composition runs,
  the same bits: a module hook (tensor parallelism sums ``wo_b``'s output in one; hooks may be
  registered after binding, so they are a per-call fact), autograd recording, an activation dtype
  the packs do not take (a model cast after it was bound), or a layer the packs cannot give the
  torch bits for (see `_build`: rows under 8 values, a ``wo_a`` kept FP8-packed, float64 weights).

A bf16 norm weight is used as an fp32 copy (made with the pack set): the torch path computes
``(rms_normalize(x) * wide(w)).to(dtype)`` for it, the same fp32 products as the native RMSNorm
with an fp32 weight, so the same bits.

The pack set is built once per registration generation (`kernels.moe.generation`: a replaced
parameter or submodule anywhere) and kept on the attention module (``_native_proj``), the negative
answer too; a pack set found stale in C++ (a watched weight edited in place) is rebuilt once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from kvshare.kernels import attn_proj
from kvshare.kernels.pack_memo import per_generation
from kvshare.kernels.packed import Packed
from kvshare.layers.attention import servable
from kvshare.layers.bound import BoundOp
from kvshare.layers.choice import KernelChoice
from kvshare.layers.norm import rms_normalize_as
from kvshare.layers.quant import fit_block
from kvshare.ops import invariant

#: `model.attention.Attention`, which builds this layer: named, not imported (no import cycle)
Attention = Any

if TYPE_CHECKING:  # (kvshare.model imports this module: its functions are imported where used)
    from kvshare.layers.linear import Linear
    from kvshare.layers.quant import QuantMode
    from kvshare.layers.rope import RotaryEmbedding

_GLOBAL_HOOKS = (nn.modules.module._global_forward_hooks, nn.modules.module._global_forward_pre_hooks)


class Owned(BoundOp):
    """A bound layer over parameters its owner module keeps (under their checkpoint names).

    The owner is held outside `nn.Module`'s registries (no submodule cycle, no duplicate parameter
    names); it is read at call time, so a replaced submodule of the owner is seen."""

    def __init__(self, owner: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "owner", owner)

    def extra_repr(self) -> str:
        return f"impl={getattr(self.impl, '__name__', self.impl)}"


class AttnIn(Owned):
    """(qr [T, q_lora], q [T, H, d], kv [T, d]) for x [T, D] at positions pos [T] (module doc)."""

    owner: "Attention"

    def select(self, choice: KernelChoice) -> Callable[..., Any]:
        return self.forward_native if choice.batch_invariant and choice.fused_attn_proj else self.forward_torch

    def forward_torch(self, x: torch.Tensor, pos: torch.Tensor, rope: "RotaryEmbedding"
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = self.owner
        qr = a.q_norm(a.wq_a(x))
        q = a.wq_b(qr).view(x.shape[0], a.n_heads, a.head_dim)
        owned = a.cfg.arch == "v4"  # q is then a fresh tensor this layer may rotate in place
        if owned:
            c = self.choice  # the per-head norm's native kernel: the same bits (layers/norm.py)
            q = rms_normalize_as(q, a.cfg.rms_norm_eps, native=c.native and c.batch_invariant and servable(q))
        q = rope.rotate(q, pos, inplace=owned)
        kv = rope.rotate(a.kv_norm(a.wkv(x)), pos, inplace=True)
        return qr, q, kv

    def forward_native(self, x: torch.Tensor, pos: torch.Tensor, rope: "RotaryEmbedding"
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = self.fused(x, pos, rope)
        return out if out is not None else self.forward_torch(x, pos, rope)

    def fused(self, x: torch.Tensor, pos: torch.Tensor, rope: "RotaryEmbedding"
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The one native call's (qr, q, kv), or None where it does not serve (module doc)."""
        a = self.owner
        if x.dim() != 2 or pos.dim() != 1 or torch.is_grad_enabled():
            return None
        for _ in range(2):  # a pack set found stale in C++ is rebuilt once
            f = fused_of(a)
            if f is None or x.dtype != f.packs.act_dtype or hooked(f.in_hooks):
                return None
            c, s, _ = rope.native_tables(pos)
            xb, qb, _ = f.blocks if f.mode.act else (0, 0, 0)
            out = attn_proj.attn_in(x, f.packs, f.norms[0], f.norms[1], a.q_norm.eps, c, s, a.n_heads, f.head_norm,
                                    xb, qb)
            if out is not None:
                return out
            a.__dict__.pop("_native_proj", None)
        return None


class AttnOut(Owned):
    """[T, D] from the attention output o [T, H, d] (rotated back in place) at positions pos [T]."""

    owner: "Attention"

    def select(self, choice: KernelChoice) -> Callable[..., Any]:
        if not choice.batch_invariant:
            return self.forward_torch
        return self.forward_native if choice.fused_attn_proj else self.forward_invariant

    def forward_torch(self, o: torch.Tensor, pos: torch.Tensor, rope: "RotaryEmbedding") -> torch.Tensor:
        a, og, wo_a = self._groups(o, pos, rope)
        return a.wo_b(torch.einsum("tgi,goi->tgo", og, wo_a).flatten(1))

    def forward_invariant(self, o: torch.Tensor, pos: torch.Tensor, rope: "RotaryEmbedding") -> torch.Tensor:
        """Per group: a row-invariant product of each row with its group's ``wo_a``."""
        a, og, wo_a = self._groups(o, pos, rope)
        u = torch.stack([invariant.row_linear(og[:, i], wo_a[i]) for i in range(a.n_groups)], dim=1).flatten(1)
        return a.wo_b(u)

    def forward_native(self, o: torch.Tensor, pos: torch.Tensor, rope: "RotaryEmbedding") -> torch.Tensor:
        y = self.fused(o, pos, rope)
        return y if y is not None else self.forward_invariant(o, pos, rope)

    def fused(self, o: torch.Tensor, pos: torch.Tensor, rope: "RotaryEmbedding") -> torch.Tensor | None:
        """The one native call's [T, D] (o rotated back in place), or None where it does not serve."""
        a = self.owner
        if o.dim() != 3 or not o.is_contiguous() or pos.dim() != 1 or torch.is_grad_enabled():
            return None
        for _ in range(2):
            f = fused_of(a)
            if f is None or o.dtype != f.packs.act_dtype or hooked(f.out_hooks):
                return None
            c, _, s_neg = rope.native_tables(pos)
            y = attn_proj.attn_out(o, f.packs, c, s_neg, f.blocks[2] if f.mode.act else 0)
            if y is not None:
                return y
            a.__dict__.pop("_native_proj", None)
        return None

    def _groups(self, o: torch.Tensor, pos: torch.Tensor, rope: "RotaryEmbedding"
                ) -> tuple["Attention", torch.Tensor, torch.Tensor]:
        """(owner, o rotated back in place and split [T, G, H d / G], wo_a's group views [G, r, H d / G])."""
        a = self.owner
        o = rope.rotate(o, pos, inverse=True, inplace=True)  # o: the attention's fresh output
        g = a.n_groups
        return a, o.reshape(o.shape[0], g, -1), a.wo_a.weight.view(g, a.cfg.o_lora_rank, -1)


# ---- the pack set -------------------------------------------------------------------------------
@dataclass(eq=False)
class Fused:
    """A layer's pack set and what a call needs besides it (kept on the module, see `fused_of`)."""

    packs: attn_proj.ProjPacks
    norms: tuple[torch.Tensor, torch.Tensor]  # q_norm, kv_norm weights in fp32 (the parameters when fp32)
    mode: "QuantMode"
    blocks: tuple[int, int, int]  # FP8 blocks of x (wq_a, wkv), qr (wq_b), u (wo_b) when mode.act
    head_norm: bool  # V4: q is RMS-normalised per head
    in_hooks: tuple[dict, ...]  # forward (pre-)hook dicts of the modules attn_in stands for
    out_hooks: tuple[dict, ...]


def hooked(hooks: tuple[dict, ...]) -> bool:
    """Whether any of the hook dicts (`hook_dicts`) or torch's global module hooks holds a hook."""
    return any(hooks) or any(_GLOBAL_HOOKS)


def hook_dicts(*mods: nn.Module) -> tuple[dict, ...]:
    """The forward and forward-pre hook dicts of `mods` (a fused call stands for their forwards)."""
    return tuple(d for m in mods for d in (m._forward_hooks, m._forward_pre_hooks))


def pack_of(lin: "Linear", w: torch.Tensor | None = None) -> tuple[Packed, torch.Tensor] | None:
    """(pack, watched tensor) of a linear (or of `w`, a view of its weight) as the torch path uses
    it: the FP8 / FP4 checkpoint pack, else `invariant.native_pack`; None when it has neither."""
    if w is None and lin.qweight is not None:
        return lin.qweight, lin.qweight.data
    p = invariant.native_pack(lin.weight if w is None else w)
    return None if p is None else (p, lin.weight)


def fused_of(attn: "Attention") -> Fused | None:
    """The layer's `Fused`, or None where the fused calls do not serve this layer (module doc)."""
    return per_generation(attn, "_native_proj", lambda: _build(attn))


def _build(attn: "Attention") -> Fused | None:
    """The layer's `Fused` from its current weights, or None where the fused calls cannot give the
    torch path's bits: a ``wo_a`` kept FP8-packed, projections of mixed quantisation modes or FP8
    blocks, norms of another eps or dtype, rows under 8 values (torch's own RMSNorm), weights the
    kernels do not pack (float64)."""

    cfg, g = attn.cfg, attn.n_groups
    qlin = (attn.wq_a, attn.wq_b, attn.wkv, attn.wo_b)
    norms = (attn.q_norm, attn.kv_norm)
    if (attn.wo_a.qweight is not None or any(q.mode is not attn.wq_a.mode for q in qlin)
            or attn.wq_a.block != attn.wkv.block or g < 1
            or any(n.weight.dtype not in (torch.float32, torch.bfloat16) or n.eps != cfg.rms_norm_eps for n in norms)
            or min(attn.head_dim, attn.wq_a.out_features) < 8):
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
