"""Pack sets registered once with the native library (csrc/pack_set.h) and named by an id.

The fused ops that multiply by many packed linears (``attn_in`` / ``attn_out`` / ``index_select``:
one attention layer's projections; ``moe_experts``: every expert of a MoE layer) take their weights
as one registered set: the dispatcher converts a Python list of tensors element by element on every
call (~85 ns a tensor, ~25 µs for a MoE layer's ~300), an int costs nothing. The library holds the
set's tensors until the `RegisteredSet` that named it is collected. Staleness stays the ops' own
check: a watched tensor whose address, in-place version or dtype changed since registration makes
them return nothing, and the caller registers a new set.
"""

from __future__ import annotations

import weakref

import torch

from kvshare.kernels.ops import ops


def _free(set_id: int) -> None:
    try:
        ops.pack_set_free(set_id)
    except Exception:  # interpreter shutdown: the library may already be gone, and with it the set
        pass


class RegisteredSet:
    """A pack set in the native registry: `id` is what the ops take; freed when this object is collected."""

    @torch.compiler.disable  # registration is a side effect on the library, not traceable work
    def __init__(self, packs: list[torch.Tensor], meta: torch.Tensor, watch: list[torch.Tensor]) -> None:
        self.id = int(ops.pack_set_new(packs, meta, watch))
        weakref.finalize(self, _free, self.id)
