"""The model's fake-quantisation policy (spec/model.md §6): which tensors are rounded, and how.

`QuantMode` (`kvshare.layers.quant`) is a small mutable switchboard shared by every module of one `Transformer`; flipping a
field (``model.quant.cache = False``) takes effect on the next forward. With every field off the
network is plain math (what transformers' DeepSeek-V4 computes).

Rounding per architecture (all wrapped in `straight_through`, so training sees identity gradients):

| tensor                      | V4.1                                   | V4                                   |
|-----------------------------|----------------------------------------|--------------------------------------|
| window KV (after RoPE)      | FP8 e4m3, all dims, block 32, ue8m0    | FP8 nope dims, block 64; rope as is  |
| compressed KV (after RoPE)  | FP4 e2m1, block 16, e4m3 scales        | same as its window KV                |
| index K and Q (after RoPE)  | FP4 e2m1, block 32, ue8m0              | Hadamard rotation, then the same FP4 |
| GEMM inputs of FP8/FP4 weights | FP8 e4m3, block `cfg.act_quant_block`, ue8m0 | same                          |

Block fitting (**kvshare decision**, only matters for tiny test models): a block that does not
divide the quantised width is shrunk to the largest power of two dividing it, so e.g. a 16-wide
latent uses FP8 blocks of 16 instead of 32. Real V4 / V4.1 widths always divide.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvshare.layers.choice import KernelChoice
from kvshare.layers.quant import QuantMode, act_quant, fit_block, fp4_round, fp8_round
from kvshare.ops.invariant import matmul_t
from kvshare.quant import straight_through

if TYPE_CHECKING:
    from kvshare.config import ModelConfig

__all__ = ["KVQuantizer", "QuantMode", "act_quant", "fit_block", "hadamard_matrix"]


def hadamard_matrix(n: int, device: torch.device | None = None) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix of size n (a power of two), scaled by n^-0.5."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two width, got {n}")
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h * n**-0.5


class KVQuantizer:
    """Applies the §6 policy for one model; holds the shared `QuantMode`."""

    def __init__(self, cfg: ModelConfig, mode: QuantMode) -> None:
        self.cfg = cfg
        self.mode = mode
        d, rd = cfg.head_dim, cfg.qk_rope_head_dim
        if cfg.arch == "v41":
            self._win_block = fit_block(d, 32)
            self._comp_block = fit_block(d, 16)
        else:
            self._win_block = fit_block(d - rd, 64) if d > rd else 0
        self._idx_block = fit_block(cfg.index_head_dim, 32) if cfg.index_head_dim else 0
        self._hadamard: torch.Tensor | None = None
        self.bind(KernelChoice.reference())

    def bind(self, choice: KernelChoice) -> None:
        """Bind the roundings to `choice` (`Transformer.bind`): the native kernels where
        ``choice.native`` (the same bits), the Hadamard product row-invariant where ``batch_invariant``."""
        self.native = choice.native
        self.invariant = choice.batch_invariant

    def _v4_nope_fp8(self, x: torch.Tensor) -> torch.Tensor:
        """V4 rows: FP8 nope dims; the rope dims are kept in bf16 (as the 584-B row stores them)."""
        rd = self.cfg.qk_rope_head_dim
        if self._win_block == 0:
            return x
        nope = fp8_round(x[..., :-rd], self._win_block, self.native)
        rope = x[..., -rd:].to(torch.bfloat16).to(x.dtype)
        return torch.cat([nope, rope], dim=-1)

    def window(self, kv: torch.Tensor) -> torch.Tensor:
        """Round a post-RoPE window KV row as it is stored."""
        if not self.mode.cache:
            return kv
        if self.cfg.arch == "v41":
            return fp8_round(kv, self._win_block, self.native)
        return straight_through(self._v4_nope_fp8, kv)

    def compressed(self, kv: torch.Tensor) -> torch.Tensor:
        """Round a post-RoPE compressed latent as it is stored."""
        if not self.mode.cache:
            return kv
        if self.cfg.arch == "v41":
            return fp4_round(kv, self._comp_block, "e4m3", self.native)
        return straight_through(self._v4_nope_fp8, kv)

    def index(self, x: torch.Tensor) -> torch.Tensor:
        """Round a post-RoPE index key or query (V4: Hadamard-rotated first; q . k is unchanged by it)."""
        if not self.mode.index:
            return x
        if self.cfg.arch == "v4":
            n = x.shape[-1]
            if self._hadamard is None or self._hadamard.device != x.device:
                self._hadamard = hadamard_matrix(n, x.device)
            x = matmul_t(x.float(), self._hadamard.t(), self.invariant).to(x.dtype)
        return fp4_round(x, self._idx_block, "ue8m0", self.native)
