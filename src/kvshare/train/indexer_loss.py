"""Lightning-indexer distillation: teach each index source to score what attention would attend.

Top-k selection is discrete, so the next-byte loss never reaches the indexer's own projections
(``indexer.wq_b``, ``weights_proj``, ``wk``, ``k_norm``). As in DeepSeek-V3.2's dense warm-up,
the indexer is trained with a KL term: for index source ``l`` and token ``t``, the target is the
main attention's distribution over ALL causal compressed entries ``j < (t + 1) // ratio``,

    target[t, j] = normalise( sum_{c reads l's top-k} sum_h softmax_j(q_c[t, h] . kv[j] * scale) ),

computed from the queries every consumer layer ``c`` actually used (captured during the forward)
and the owner's compressed-KV table in the `DenseCache`, detached. The indexer's distribution is
``softmax_j(I[t, j])`` of the raw index scores the model computed (captured, differentiable), and
the loss is ``KL(target || indexer)`` averaged over token rows with at least one causal entry.

Capture works by wrapping, for the duration of one forward, the functions the model's layers
call (``index_scores`` / ``candidate_scores`` in `layers/index_select.py`, ``sparse_attention`` /
``prefix_attention`` in `layers/attention.py`) and by forward pre-hooks naming the layer that runs;
the model code is unchanged. While capturing, candidate-restricted scoring is replaced by full
scoring (the model masks with the candidates afterwards, so it selects the same rows), because the
KL needs every causal entry's score.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F

import kvshare.layers.attention as attention_mod
import kvshare.layers.index_select as indexer_mod
from kvshare.step import StepBatch


class Capture:
    """What one forward exposed: raw index scores per index source, attention queries per layer."""

    def __init__(self) -> None:
        self.layer: int | None = None
        self.scores: dict[int, torch.Tensor] = {}
        self.queries: dict[int, tuple[torch.Tensor, float]] = {}


@contextlib.contextmanager
def capture(model: Any) -> Iterator[Capture]:
    """Record index scores and attention queries of every layer during the forwards inside."""
    cap = Capture()
    orig_scores, orig_attn = indexer_mod.index_scores, attention_mod.sparse_attention
    orig_cand, orig_prefix = indexer_mod.candidate_scores, attention_mod.prefix_attention

    def scores(*args: Any, **kw: Any) -> torch.Tensor:
        out = orig_scores(*args, **kw)
        if cap.layer is not None:
            cap.scores[cap.layer] = out
        return out

    def attn(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
        if cap.layer is not None:
            cap.queries[cap.layer] = (q, scale)
        return orig_attn(q, kv, valid, sink, scale)

    def cand(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, seq: torch.Tensor, mask: torch.Tensor,
             cap_rows: int) -> torch.Tensor:
        return scores(q, w, keys, seq)

    def prefix(q: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        if cap.layer is not None:
            cap.queries[cap.layer] = (q, args[7])  # (win, starts, comp, mask, seq, rank, sink, scale)
        return orig_prefix(q, *args, **kw)

    hooks = [blk.attn.register_forward_pre_hook(lambda m, a, i=i: setattr(cap, "layer", i))
             for i, blk in enumerate(model.layers)]
    indexer_mod.index_scores, attention_mod.sparse_attention = scores, attn
    indexer_mod.candidate_scores, attention_mod.prefix_attention = cand, prefix
    try:
        yield cap
    finally:
        indexer_mod.index_scores, attention_mod.sparse_attention = orig_scores, orig_attn
        indexer_mod.candidate_scores, attention_mod.prefix_attention = orig_cand, orig_prefix
        for h in hooks:
            h.remove()


def indexer_kl(model: Any, cap: Capture, cache: Any, batch: StepBatch) -> torch.Tensor:
    """Mean KL(attention target || indexer) over index sources and token rows (see module doc)."""
    topo, cfg = model.topo, model.cfg
    total = torch.zeros(())
    terms = 0
    for src, raw in cap.scores.items():
        ratio = cfg.compress_ratios[src]
        consumers = [c for c in range(cfg.num_hidden_layers) if topo[c].index_source == src and c in cap.queries]
        table = cache.region_rows("kv", src)
        if not consumers or table is None:
            continue
        n_entries = raw.shape[1]
        causal = torch.arange(n_entries)[None, :] < torch.div(batch.positions + 1, ratio, rounding_mode="floor")[:, None]
        with torch.no_grad():
            target = torch.zeros(raw.shape, dtype=torch.float32)
            for c in consumers:
                q, scale = cap.queries[c]
                for i in range(batch.num_seqs):
                    a, b = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
                    kv = table[batch.slots[i], :n_entries].float()
                    s = torch.einsum("thd,jd->thj", q[a:b].float(), kv) * scale
                    s = s.masked_fill(~causal[a:b, None, :], float("-inf"))
                    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
                    target[a:b] += p.sum(dim=1)
            target = target / target.sum(dim=-1, keepdim=True).clamp_min(1e-12)
        rows = causal.any(dim=1)
        if not bool(rows.any()):
            continue
        logq = F.log_softmax(raw.float().masked_fill(~causal, float("-inf")), dim=-1)
        logq = logq.masked_fill(~causal, 0.0)
        kl = (target * (target.clamp_min(1e-12).log() - logq)).sum(dim=-1)
        total = total + kl[rows].mean()
        terms += 1
    return total / max(terms, 1)
