"""Sparse attention over gathered KV rows with a per-head sink (spec/model.md §4.7).

Shared-KV MQA: the same d-wide row is key and value. For query row t, head h:
``s_i = q . kv_i * scale`` for valid i; ``m = max(max_i s_i, sink_h)``;
``o = sum_i exp(s_i - m) kv_i / (sum_i exp(s_i - m) + exp(sink_h - m))``.
The sink appears in the denominator only. A row with no valid entry returns 0 (never NaN).
Computed in fp32, returned in q's dtype.
"""

from __future__ import annotations

import torch
from kvshare.precision import wide


def sparse_attention(
    q: torch.Tensor,  # [T, H, d]
    kv: torch.Tensor,  # [T, M, d] rows gathered per query row
    valid: torch.Tensor,  # [T, M] bool
    sink: torch.Tensor,  # [H] fp32 logits
    scale: float,
) -> torch.Tensor:
    """[T, H, d] attention output (see module doc)."""
    kvf = wide(kv)
    s = torch.einsum("thd,tmd->thm", wide(q), kvf) * scale
    s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
    sink_f = wide(sink).unsqueeze(0).expand(s.shape[0], -1)  # [T, H]
    m = torch.maximum(s.amax(dim=-1), sink_f) if s.shape[-1] else sink_f
    p = torch.exp(s - m.unsqueeze(-1))
    denom = p.sum(dim=-1) + torch.exp(sink_f - m)
    o = torch.einsum("thm,tmd->thd", p, kvf) / denom.unsqueeze(-1)
    return o.to(q.dtype)
