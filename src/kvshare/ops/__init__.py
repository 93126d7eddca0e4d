"""Pure tensor ops of the model: top-k with causality, candidate blocks, index scores, sparse attention."""

from kvshare.ops.candidates import block_scores, candidate_block_mask
from kvshare.ops.index_scores import index_scores
from kvshare.ops.sparse_attention import sparse_attention
from kvshare.ops.topk import boundary_ties, causal_mask, select_topk, stable_topk

__all__ = [
    "block_scores", "boundary_ties", "candidate_block_mask", "causal_mask", "index_scores",
    "select_topk", "sparse_attention", "stable_topk",
]
