"""The dense-attention baseline for the context-scaling benchmark.

What one decode step's attention would cost if every layer attended densely over the whole
context, with the model's own shapes: per layer, `heads` query heads of width `head_dim` against
one shared KV head (MQA) of `context` positions. Two dense formulations are timed and the faster
is kept (a fair baseline): ``scaled_dot_product_attention`` and the plain matmul-softmax-matmul
(with one query row the latter is often faster on CPU). Only the attention is timed (no projections), so the sparse engine's full step is compared with a
lower bound of the dense engine's step growth.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvshare.bench.measure import StepTimes, now


def dense_attention_step(batch: int, heads: int, head_dim: int, context: int, layers: int,
                         dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                         repeats: int = 3) -> StepTimes:
    """Median-able times of `layers` dense SDPA calls (one decode token per sequence)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(batch, heads, 1, head_dim, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(batch, 1, context, head_dim, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(batch, 1, context, head_dim, generator=g).to(device=device, dtype=dtype)
    scale = head_dim ** -0.5

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def matmul() -> torch.Tensor:
        s = torch.matmul(q.squeeze(2), k.squeeze(1).transpose(1, 2)) * scale  # [B, H, context]
        return torch.matmul(torch.softmax(s, dim=-1), v.squeeze(1))

    best = StepTimes()
    with torch.inference_mode():
        for fn in (sdpa, matmul):
            fn()  # warm-up
            times = StepTimes()
            for _ in range(repeats):
                t0 = now(device)
                for _ in range(layers):
                    fn()
                times.add(now(device) - t0)
            if not best.seconds or times.median < best.median:
                best = times
    return best
