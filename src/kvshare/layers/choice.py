"""`KernelChoice`: which implementation each op of a model runs, decided once per model build."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class KernelChoice:
    """The implementations a model's layers bind (`BoundOp.bind`), fixed for the model's lifetime
    until the next `bind_model`.

    Invariants (kept by `resolve`, assumed by every layer's `select`):
    * ``native`` only where kvshare's native library loads and serves this machine (an ISA other
      than "torch"), on the CPU, for a bf16 / fp32 model without autograd: the layers' native
      implementations may then assume contiguous CPU activations of the model's dtype, and fall
      back inside themselves only where the bits stay the same (a stale pack, a dtype not packed);
    * ``attention``, ``fused_mhc``, ``fused_attn_proj`` imply ``native``, which implies ``gemm``;
    * ``batch_invariant``: every row's bits depend on that row alone (`ops/invariant.py`); the
      layers bind their row-invariant implementations (native or torch) for it.

    ``native`` without ``batch_invariant`` is the batched mode: only the native kernels whose bits
    are the torch op's whatever the batch (RoPE, FP8 activation rounding, packed FP8 / FP4 GEMMs).
    """

    batch_invariant: bool = False
    #: kvshare's GEMM kernels: packed FP8 / FP4 weights multiplied as stored, the row-invariant
    #: fixed-order products of the batch-invariant mode
    gemm: bool = False
    #: kvshare's native decode kernels (norms, RoPE, mHC, MoE routing, FP8 rounding, cache rows, ...)
    native: bool = False
    #: the native sparse / paged attention and index scores (own summation order, bounded in tests)
    attention: bool = False
    #: a sublayer's mHC work as one native call (the same bits as the unfused native calls)
    fused_mhc: bool = False
    #: attention's input / output projections and the indexer's query side as one native call each
    fused_attn_proj: bool = False

    @classmethod
    def reference(cls) -> "KernelChoice":
        """The pure-torch reference: no native kernel, batched products (autograd-capable)."""
        return cls()

    def with_(self, **changes: bool) -> "KernelChoice":
        """A copy with `changes`, re-normalised (turning ``gemm`` / ``native`` off turns their dependants off)."""
        return replace(self, **changes).normalised()

    def normalised(self) -> "KernelChoice":
        """This choice with the implications above enforced."""
        if not self.gemm:
            return replace(self, native=False, attention=False, fused_mhc=False, fused_attn_proj=False)
        if not self.native:
            return replace(self, attention=False, fused_mhc=False, fused_attn_proj=False)
        return self
