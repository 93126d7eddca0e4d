"""A KV compressor's two units (spec/model.md §4.5), bound once: `CompressProject`, `CompressPool`.

`CompressProject(x, ctx)` -> az [T, 2 coff d] fp32: ``[wkv(x) | wgate(x) + ape[t mod ratio]]`` of the
widened rows (the history ring's rows). `CompressPool(hist, valid, dtype)` -> [G, d] in `dtype`:
per group and channel, the softmax over its slots of z weighting a (overlap: the first half of the
previous group's slots, then the second half of its own), slots with ``valid`` False (positions
before 0) taking no weight. Neither holds parameters: the projection reads its compressor's
(``wkv``, ``wgate``, ``ape`` keep their checkpoint names there).

`CompressProject` implementations:
* ``forward_torch`` (the batched mode): two products (`F.linear`), the APE one add;
* ``forward_invariant`` (batch-invariant without kvshare's GEMMs): two row-invariant products;
* ``forward_packed`` (batch-invariant with the GEMMs): one product with the kernels' fp32 pack of
  ``cat([wide(wkv), wide(wgate)])`` (each output the fixed-order kernel's sum over K alone: the bits
  of the two products), made once per version of the two weights (`pack`);
* ``forward_native`` (and the native decode kernels): that product and the APE in one call
  (`kernels.decode.project_wide`).
Per call, where the pack cannot serve (no pack for float64 weights or another device; activations
the pack does not take) the row-invariant products run.

`CompressPool` implementations: ``forward_torch`` everywhere, except ``forward_native`` in a
batch-invariant model with the native kernels and d a multiple of 64 (the released 128 / 512 and
64 / 128: the same bits in one call, `kernels.decode.compress_pool`; for narrower or odd rows
torch's softmax / sum take other loops, so they keep the torch code). Per call, rows that are not
fp32 on the CPU, or activations autograd tracks, run the torch code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F

from kvshare import kernels
from kvshare.kernels import decode as native
from kvshare.kernels.pack_memo import per_generation
from kvshare.layers.attention import servable
from kvshare.layers.attn_proj import Owned
from kvshare.layers.bound import BoundOp
from kvshare.layers.choice import KernelChoice
from kvshare.ops import invariant
from kvshare.precision import version_of, wide

#: `model.compressor.Compressor`, which builds this layer: named, not imported (no import cycle)
Compressor = Any

if TYPE_CHECKING:
    from kvshare.step.context import StepContext


class CompressProject(Owned):
    """[a | z + ape] fp32 of a ratio > 1 compressor's inputs (module doc)."""

    owner: "Compressor"

    def __init__(self, owner: "Compressor") -> None:
        super().__init__(owner)
        self._fused: tuple[tuple, kernels.Packed] | None = None  # see `pack`

    def select(self, choice: KernelChoice) -> Callable[..., Any]:
        if not choice.batch_invariant:
            return self.forward_torch
        if not choice.gemm:
            return self.forward_invariant
        return self.forward_native if choice.native else self.forward_packed

    def forward_torch(self, x: torch.Tensor, ctx: "StepContext") -> torch.Tensor:
        return self._products(x, ctx, F.linear)

    def forward_invariant(self, x: torch.Tensor, ctx: "StepContext") -> torch.Tensor:
        return self._products(x, ctx, invariant.row_linear)

    def forward_packed(self, x: torch.Tensor, ctx: "StepContext") -> torch.Tensor:
        packed = self.pack()
        if packed is None or wide(x).dtype != packed.act_dtype:
            return self.forward_invariant(x, ctx)
        az = kernels.linear_checked(wide(x), packed)
        ape = self._held()[2]
        if ape is not None:
            az[:, self.owner.coff * self.owner.dim:] += wide(ape)[ctx.addr.phase(self.owner.ratio)]
        return az

    def forward_native(self, x: torch.Tensor, ctx: "StepContext") -> torch.Tensor:
        packed = self.pack()
        if packed is not None and packed.fmt == "fp32" and servable(x):
            ape = self._held()[2]
            # [a | z] and the APE in one call: each output is the fixed-order kernel's sum over K
            # alone (the same bits as the two products), the APE one rounded add
            return native.project_wide(x, packed, None if ape is None else wide(ape), ctx.positions,
                                       self.owner.coff * self.owner.dim)
        return self.forward_packed(x, ctx)

    def pack(self) -> "kernels.Packed | None":
        """The kernels' pack of ``cat([wide(wkv), wide(wgate)])`` (rows [a | z]), made once per version
        of the two weights; None where the kernels do not take them (no native library, not the
        CPU, float64)."""
        wkv, wgate, _ = self._held()
        key = (wkv.data_ptr(), version_of(wkv), wgate.data_ptr(), version_of(wgate), wkv.dtype, wgate.dtype)
        fused = self._fused
        if fused is not None and fused[0] == key:  # (a pack exists only where the checks below held)
            return fused[1]
        if not kernels.available() or wkv.device.type != "cpu" or wkv.dtype == torch.float64:
            return None
        with torch.no_grad():
            self._fused = (key, kernels.pack(torch.cat([wide(wkv), wide(wgate)]).detach()))
        return self._fused[1]

    def _products(self, x: torch.Tensor, ctx: "StepContext", linear: Callable[..., torch.Tensor]) -> torch.Tensor:
        wkv, wgate, ape = self._held()
        xf = wide(x)
        a, z = linear(xf, wide(wkv)), linear(xf, wide(wgate))
        if ape is not None:
            z = z + wide(ape)[ctx.addr.phase(self.owner.ratio)]
        return torch.cat([a, z], dim=-1)

    def _held(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(wkv weight, wgate weight, APE or None) kept per `kernels.moe.generation` (a replaced
        parameter or submodule anywhere starts a new one): the parameters without the module
        attribute lookups of every decode step."""
        c = self.owner
        return per_generation(c, "_held_params", lambda: (c.wkv.weight, c.wgate.weight, c.ape if c.has_ape else None))


class CompressPool(BoundOp):
    """The softmax pooling of each completed group's history rows (module doc)."""

    def __init__(self, ratio: int, dim: int, overlap: bool) -> None:
        super().__init__()
        self.ratio, self.dim, self.overlap = ratio, dim, overlap

    def select(self, choice: KernelChoice) -> Callable[..., Any]:
        native_ok = choice.batch_invariant and choice.native and self.dim % 64 == 0
        return self.forward_native if native_ok else self.forward_torch

    def extra_repr(self) -> str:
        return f"ratio={self.ratio}, dim={self.dim}, overlap={self.overlap}, impl={self.impl.__name__}"

    def forward_torch(self, hist: torch.Tensor, valid: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """`hist` [G, coff ratio, 2 coff d] the groups' ring rows [a | z], `valid` [G, coff ratio]
        (None: every slot valid) -> [G, d] in `dtype`."""
        w = (2 if self.overlap else 1) * self.dim
        kv, score = hist[..., :w], hist[..., w:]
        if self.overlap:
            r, d = self.ratio, self.dim
            kv = torch.cat([kv[:, :r, :d], kv[:, r:, d:]], dim=1)
            score = torch.cat([score[:, :r, :d], score[:, r:, d:]], dim=1)
        if valid is not None:  # positions before 0 (a prompt's first groups) take no weight
            score = score.masked_fill(~valid.unsqueeze(-1), float("-inf"))
            kv = kv.masked_fill(~valid.unsqueeze(-1), 0.0)
        return (torch.softmax(score, dim=1) * kv).sum(dim=1).to(dtype)

    def forward_native(self, hist: torch.Tensor, valid: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        if hist.dtype != torch.float32 or (torch.is_grad_enabled() and hist.requires_grad):
            return self.forward_torch(hist, valid, dtype)
        return native.compress_pool(hist, valid, self.dim, self.overlap, dtype)
