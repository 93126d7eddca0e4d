"""Linear layers whose input is FP8-rounded when the checkpoint weight is FP8/FP4 (spec/model.md §6).

In DeepSeek's reference every GEMM with an FP8 or FP4 weight quantises its activation to FP8 e4m3
in blocks of `act_quant_block` (32 in V4.1, 128 in V4) with power-of-two scales. bf16/fp32 linears
(`wo_a`, `weights_proj`, `wk`, compressor projections, the MoE gate, the head) see raw inputs.

**Packed bf16 weights** (a speed choice, bit-neutral): on the CPU a bf16 `F.linear` makes oneDNN
reorder the weight into its blocked layout on every call. `Linear.pack()` does that reorder once
(``torch.ops.mkldnn._reorder_linear_weight``) and later calls use ``_linear_pointwise`` on the
packed copy, which gives bitwise the same result as `F.linear` (tests/test_packed_linear.py) and
is 1.3-6x faster at 1-8 rows on this machine. Packing is feature-checked (`packing_available`);
without it, or for fp32 / float64 weights, or while autograd needs the weight, `F.linear` runs.
A packed copy is dropped as soon as the weight changes (its version counter or storage moved;
an inference-mode weight has no version counter, so re-`pack()` after editing one in place).

**kvshare's own kernels** (`kvshare.kernels`, fixed reduction order, row-count invariant):

* A weight loaded from an FP8 / FP4 checkpoint into a bf16 model stays packed (`set_packed`): the
  `weight` parameter is then empty and every call runs ``kernels.linear`` on the packed form
  (the math is that of the dequantised weight; the bits can differ from oneDNN's in the last place).
* A model bound batch-invariant (`KernelChoice.batch_invariant`) runs every other linear through
  `ops.invariant.row_linear`, which uses the kernels too where they are available.

**Binding** (`kvshare.layers`): `bind(choice)` picks the implementation once:
`forward_packed` (a weight kept packed: any choice), `forward_invariant` (a batch-invariant choice),
else `forward_torch` (oneDNN's packed copy / `F.linear`, the reference). `set_packed` rebinds. A
`QLinear` also binds whether its FP8 input rounding runs the native kernel (a native choice).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from typing import Callable

from kvshare import kernels
from kvshare.layers.choice import KernelChoice
from kvshare.layers.quant import QuantMode, act_quant
from kvshare.ops import invariant
from kvshare.precision import version_of


@functools.cache
def packing_available() -> bool:
    """Whether oneDNN's prepacked bf16 linear ops exist in this torch build AND run on this CPU.

    The ops exist in every x86 build, but their bf16 path needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT:
    on an AVX2-only CPU (or under ``ONEDNN_MAX_CPU_ISA=AVX2``) the reorder raises, so one tiny
    reorder is tried once and its failure means "use F.linear"."""
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        if not (torch.backends.mkldnn.is_available() and ops is not None
                and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
            return False
        w = torch.zeros(16, 16, dtype=torch.bfloat16)
        packed = ops._reorder_linear_weight(w, None)
        ops._linear_pointwise(torch.zeros(1, 16, dtype=torch.bfloat16), packed, None, "none", [], "")
        return True
    except (AttributeError, RuntimeError):
        return False


class Linear(nn.Linear):
    """Bias-free `nn.Linear` that can hold a once-packed bf16 copy of its weight (see module doc).

    Invariant: `impl` is `select(choice)` for the last `bind` choice and the current `qweight`.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self._packed: torch.Tensor | None = None
        self._packed_key: tuple[int, int] | None = None
        self._pack_wanted = False  # `pack()` asked for a oneDNN copy: made by the first forward_torch
        self.qweight: kernels.Packed | None = None  # an FP8 / FP4 checkpoint weight kept packed
        self.bind(KernelChoice.reference())

    def bind(self, choice: KernelChoice) -> None:
        """Choose this linear's implementation for `choice` (see the module doc)."""
        self.choice = choice
        self.impl: Callable[[torch.Tensor], torch.Tensor] = self.select(choice)

    def select(self, choice: KernelChoice) -> Callable[[torch.Tensor], torch.Tensor]:
        if self.qweight is not None:  # fixed-order kernel: row-invariant in any mode
            return self.forward_packed
        return self.forward_invariant if choice.batch_invariant else self.forward_torch

    def set_packed(self, packed: kernels.Packed) -> None:
        """Hold `packed` (shape [out, in]) instead of a dense weight; `weight` becomes empty."""
        if (packed.n, packed.k) != (self.out_features, self.in_features):
            raise ValueError(f"packed weight is {packed.n} x {packed.k}, this Linear is "
                             f"{self.out_features} x {self.in_features}")
        self.qweight = packed
        self.weight = nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
        self._packed, self._pack_wanted = None, False
        self.bind(self.choice)

    def _key(self) -> tuple[int, int]:
        return (self.weight.data_ptr(), version_of(self.weight))

    def pack(self) -> bool:
        """Ask for a oneDNN copy of the weight when it is a bf16 CPU tensor and packing exists; True if
        it will be used. The copy is made by the first `forward_torch` (the batched mode's), so a model
        bound batch-invariant or to the packed kernels, which never read it, holds none."""
        w = self.weight
        if self.qweight is not None or w.dtype != torch.bfloat16 or w.device.type != "cpu" or not packing_available():
            self._packed, self._pack_wanted = None, False
            return False
        if self._packed is not None and self._packed_key != self._key():
            self._packed = None
        self._pack_wanted = True
        return True

    def _onednn_weight(self) -> torch.Tensor:
        """The oneDNN copy of `weight`, made now if it is not there yet."""
        if self._packed is None:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
            self._packed_key = self._key()
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.impl(x)

    def forward_packed(self, x: torch.Tensor) -> torch.Tensor:
        """The FP8 / FP4 weight as stored, multiplied by kvshare's fixed-order kernel."""
        return kernels.linear(x, self.qweight)  # type: ignore[arg-type]

    def forward_invariant(self, x: torch.Tensor) -> torch.Tensor:
        """Every row alone (`ops.invariant.row_linear`)."""
        return invariant.row_linear(x, self.weight)

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        """The reference: `F.linear`, or oneDNN's prepacked copy of a bf16 weight (the same bits)."""
        if self._pack_wanted and x.dtype == torch.bfloat16 and not (torch.is_grad_enabled() and self.weight.requires_grad):
            packed = self._onednn_weight()
            if self._packed_key == self._key():
                return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            self._packed, self._pack_wanted = None, False
        return F.linear(x, self.weight)


class QLinear(Linear):
    """`Linear` standing for an FP8/FP4 checkpoint weight.

    When ``mode.act`` is on, the input is rounded to FP8 (block `block`) before the product; the
    weight is used as loaded (dequantised, or kept packed by the loader: `set_packed`).
    """

    def __init__(self, in_features: int, out_features: int, mode: QuantMode, block: int) -> None:
        super().__init__(in_features, out_features)
        self.mode = mode
        self.block = block

    def bind(self, choice: KernelChoice) -> None:
        self.native_act = choice.native  # the FP8 rounding's native kernel (the same bits, any mode)
        super().bind(choice)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode.act:
            x = act_quant(x, self.block, self.native_act)
        return self.impl(x)


def plain_linear(in_features: int, out_features: int) -> Linear:
    """A bias-free linear whose input is never quantised."""
    return Linear(in_features, out_features)


def pack_linears(model: nn.Module) -> int:
    """Pack every bf16 `Linear` of `model` (see module doc); returns how many were packed."""
    return sum(m.pack() for m in model.modules() if isinstance(m, Linear))
