"""The loss both training and evaluation use: next-byte cross-entropy through the inference model.

Contexts of several sequences go through ``Transformer.forward`` as ONE ragged StepBatch, every
sequence from position 0, with a fresh cache backend per step, exactly as a batched prefill at
inference time. The logits of every row are compared with the next token; the last token of each
context has no target and is not fed.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F

from kvshare.step import StepBatch

CacheFactory = Callable[[Any, StepBatch], Any]  # (model, batch) -> CacheBackend


def dense_cache_factory(model: Any, batch: StepBatch) -> Any:
    """A fresh reference cache (`cache/dense.py`) sized for the step's sequences.

    With autograd on, its compressed-row writes are out of place, so a loss in the same forward
    reaches the compressors and the index-key projections through the rows they wrote.
    """
    from kvshare.cache.dense import DenseCache

    return DenseCache(model.cfg, model.topo, num_slots=batch.num_seqs, max_len=int(batch.ends.max()))


def prepare(model: Any, contexts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, StepBatch]:
    """(input ids [T], targets [T], StepBatch): all but the last token of each context, from position 0."""
    if not contexts or min(int(c.numel()) for c in contexts) < 2:
        raise ValueError("every context needs at least 2 tokens (one input, one target)")
    device = next(model.parameters()).device
    inputs = torch.cat([c[:-1] for c in contexts]).to(device)
    targets = torch.cat([c[1:] for c in contexts]).to(device)
    lens = [int(c.numel()) - 1 for c in contexts]
    return inputs, targets, StepBatch.build([0] * len(lens), lens, device=device)


def forward_contexts(
    model: Any, contexts: list[torch.Tensor], cache_factory: CacheFactory = dense_cache_factory
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [T, vocab] for all but the last token of each context, and the matching targets [T].

    Every context is one sequence of the step, starting at position 0.
    """
    inputs, targets, batch = prepare(model, contexts)
    logits = model(inputs, batch, cache_factory(model, batch))
    return logits, targets


def train_losses(model: Any, contexts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(next-byte cross-entropy, indexer distillation KL) of one training step (`indexer_loss.py`)."""
    from kvshare.train.indexer_loss import capture, indexer_kl

    inputs, targets, batch = prepare(model, contexts)
    cache = dense_cache_factory(model, batch)
    with capture(model) as cap:
        logits = model(inputs, batch, cache)
    return F.cross_entropy(logits.float(), targets), indexer_kl(model, cap, cache, batch)


def lm_loss(
    model: Any, contexts: list[torch.Tensor], cache_factory: CacheFactory = dense_cache_factory
) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) over all predicted positions of the contexts (for gradients,
    `model` must be bound to `KernelChoice.reference()`: the native implementations assume no autograd)."""
    logits, targets = forward_contexts(model, contexts, cache_factory)
    return F.cross_entropy(logits.float(), targets)


def token_nll(
    model: Any, contexts: list[torch.Tensor], cache_factory: CacheFactory = dense_cache_factory
) -> torch.Tensor:
    """Per-position negative log-likelihood (nats) [T] of each context's tokens after the first."""
    logits, targets = forward_contexts(model, contexts, cache_factory)
    return F.cross_entropy(logits.float(), targets, reduction="none")


def lr_at(step: int, total: int, peak: float, warmup: int, min_ratio: float, decay_start: int = 0) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay from `peak` to `peak * min_ratio` at `total`.

    With `decay_start` > 0 the schedule is warm-up / stable / decay: `peak` until `decay_start`,
    then the cosine runs over [decay_start, total] only."""
    if step < warmup:
        return peak * (step + 1) / warmup
    begin = max(warmup, decay_start)
    if step < begin:
        return peak
    frac = min(1.0, (step - begin) / max(1, total - begin))
    return peak * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * frac)))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: matrices (dim >= 2, not embeddings) decay; vectors, norms, gains and embeddings do not."""
    decay, keep = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.dim() >= 2 and "embed" not in name and not name.endswith("head.weight"):
            decay.append(p)
        else:
            keep.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]
