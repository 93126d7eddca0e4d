"""TrainCache: the reference DenseCache with compressed rows that carry gradients.

`DenseCache` stores compressed rows (``"kv"``, ``"index_k"``) with an in-place, detached write, so
a loss computed in the same step cannot reach the compressor or the index-key projection through
them. Training runs every context as one prefill from position 0 into a fresh cache, so the rows a
layer reads were written earlier in the same forward; here a write rebuilds the owner's table
out of place (``index_put``), keeping the autograd graph. Sliding-window and compressor-state
history already hands this step's rows back undetached, so it is inherited unchanged.
"""

from __future__ import annotations

import torch

from kvshare.model.dense_cache import DenseCache
from kvshare.runtime import StepBatch


class TrainCache(DenseCache):
    """`DenseCache` whose compressed-row writes are differentiable (training, one step per cache)."""

    def write_rows(self, kind: str, layer: int, seq: torch.Tensor, index: torch.Tensor, values: torch.Tensor,
                   batch: StepBatch) -> None:
        """Store values[e] as row index[e] of sequence seq[e], out of place so gradients flow."""
        table = self._table(kind, layer, values.shape[-1])
        assert table is not None
        if index.numel() and int(index.max()) >= table.shape[1]:
            raise IndexError(f"compressed row {int(index.max())} of layer {layer} exceeds max_len {self.max_len}")
        self.rows[(kind, layer)] = table.index_put((batch.slots[seq], index), values.to(table.dtype))
