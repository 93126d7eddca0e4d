"""Engram (spec/engram_dspark.md §1.7-§1.10; spec/model.md §7.1, §7.3): n-gram memory added to the
residual streams at the start of block L, before that block's mHC mixes.

Per token t with row ids ``r[t]`` [cols] (from `EngramHasher`) and streams x [T, hc, D]:

* ``e = dequant(table[r[t]])`` flattened in column order to [cols * d_e];
* ``kv = wkv(e)`` (an FP8 linear: input act-quantised like every FP8 GEMM), split into hc keys
  [hc, D] then one shared value [D];
* per stream j: ``dot = sum_d(x_j * q_j * k_j * key_j) * rsqrt(mean(x_j^2) + eps) *
  rsqrt(mean(key_j^2) + eps) / sqrt(D)``, ``g_j = sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot))``
  (eps = rms_norm_eps; q, k = ``q_weight``, ``k_weight``);
* ``x'_j = x_j + g_j * value``, computed in fp32 (or wider) and cast back once. A DEAD (image)
  token gets g = 0.

The V4.1 lagged `pre` stays as it is: block L collapses its attention input with the `pre` layer
L-1's FFN computed from the pre-Engram stream, while L's own mixes see the post-Engram stream.

The table (`EngramTable`) is host memory and not a parameter: moving the model to a device or a
dtype leaves it on the CPU; a lookup's rows are moved to the streams' device. It is frozen (FP8
codes): training updates ``wkv``, ``q_weight`` and ``k_weight`` only.

Per-request state: none. A token's look-back ids come from the step's own tokens and, for the
first N-1 tokens of a chunk, from ``StepBatch.prev_tokens`` (the sequence's committed ids before
the chunk), so chunked prefill, decode, recompute after preemption, prefix-cache hits and
speculative verification all hash exactly as one full prefill (`lookback_ids`). `engram_hasher`
builds a config's hasher over the model's tokenizer (its compressed map must have the config's size).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kvshare.config import ModelConfig
from kvshare.errors import ConfigError
from kvshare.model.engram_hash import EngramHasher, EngramLayout
from kvshare.model.engram_table import EngramTable
from kvshare.layers.choice import KernelChoice
from kvshare.layers.linear import QLinear
from kvshare.model.quantize import QuantMode
from kvshare.ops.invariant import pointwise
from kvshare.precision import wide
from kvshare.step import StepBatch

GATE_CLAMP = 1e-6


class Engram(nn.Module):
    """One layer's Engram: ``wkv.weight`` [(hc+1) D, cols d_e], ``q_weight`` / ``k_weight`` [hc, D], a table."""

    def __init__(self, cfg: ModelConfig, layer: int, mode: QuantMode) -> None:
        super().__init__()
        self.layer = layer
        self.index = cfg.engram_layer_ids.index(layer)
        self.eps = cfg.rms_norm_eps
        hc, d = cfg.hc_mult, cfg.hidden_size
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        self.wkv = QLinear(cols * cfg.engram_head_dim, (hc + 1) * d, mode, cfg.act_quant_block)
        self.q_weight = nn.Parameter(torch.ones(hc, d))
        self.k_weight = nn.Parameter(torch.ones(hc, d))
        self.table: EngramTable | None = None
        # Tensor parallelism (parallel/engram_shard.py): (first column, end column, first table row,
        # all-gather) of this rank's hash columns; the table then holds only those columns' rows.
        self.tp_columns: tuple[int, int, int, Any] | None = None
        self.invariant = False  # the gate's sigmoid row-invariant (`bind`)

    def bind(self, choice: KernelChoice) -> None:
        """Bind to `choice` (`kvshare.layers.bind_model`): the gate's element-wise sigmoid through
        `ops.invariant.pointwise`'s vector loop for a batch-invariant choice."""
        self.invariant = choice.batch_invariant

    def forward(self, h: torch.Tensor, row_ids: torch.Tensor, dead: torch.Tensor | None = None) -> torch.Tensor:
        """Streams [T, hc, D] after the Engram add; `row_ids` [T, cols], `dead` [T] bool (gate closed)."""
        if self.table is None:
            raise RuntimeError(f"layer {self.layer}: the Engram table is not loaded (load the checkpoint, or "
                               "call init_weights for a random model)")
        t, hc, d = h.shape
        if self.tp_columns is None:
            e = self.table.lookup(row_ids, h.dtype).reshape(t, -1).to(h.device)
        else:
            lo, hi, base, gather = self.tp_columns
            e = gather(self.table.lookup(row_ids[:, lo:hi] - base, h.dtype).reshape(t, -1).to(h.device))
        kv = self.wkv(e)
        key = wide(kv[:, : hc * d]).view(t, hc, d)
        value = wide(kv[:, hc * d:])
        x = wide(h)
        w = wide(self.q_weight) * wide(self.k_weight)
        r = torch.rsqrt(x.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (x * w * key).sum(-1) * r / math.sqrt(d)
        gate = pointwise(torch.sigmoid, torch.copysign(dot.abs().clamp_min(GATE_CLAMP).sqrt(), dot), self.invariant)
        if dead is not None:
            gate = gate.masked_fill(dead.unsqueeze(-1), 0.0)
        return (x + gate.unsqueeze(-1) * value.unsqueeze(1)).to(h.dtype)


def lookback_ids(input_ids: torch.Tensor, batch: StepBatch, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw ids [T, n], valid [T, n]) on the CPU: column s is the id at position p - s of token t's
    sequence (0 where p - s < 0, with valid False). Ids before the chunk come from
    ``batch.prev_tokens`` [N, K] (oldest first, last column = position ``starts[i] - 1``)."""
    ids = input_ids.to("cpu", torch.int64)
    pos, seq = batch.positions.cpu(), batch.seq_index.cpu()
    off = pos - batch.starts.cpu()[seq]  # offset of each token inside its chunk
    shifts = torch.arange(n)
    valid = (pos.unsqueeze(1) - shifts) >= 0
    in_chunk = shifts.unsqueeze(0) <= off.unsqueeze(1)
    rows = (torch.arange(ids.numel()).unsqueeze(1) - shifts).clamp_min(0)
    raw = ids[rows]
    before = valid & ~in_chunk
    if bool(before.any()):
        back = shifts.unsqueeze(0) - off.unsqueeze(1)  # how many positions before the chunk start
        prev = batch.prev_tokens
        need = int(back[before].max())
        if prev is None or prev.shape[1] < need:
            have = 0 if prev is None else prev.shape[1]
            raise RuntimeError(f"Engram needs the {need} token ids before each chunk in StepBatch.prev_tokens "
                               f"(it has {have}); build the batch with prev_tokens")
        prev = prev.to("cpu", torch.int64)
        k = prev.shape[1]
        from_prev = prev[seq.unsqueeze(1).expand(-1, n), (k - back).clamp(0, k - 1)]
        raw = torch.where(before, from_prev, raw)
    return torch.where(valid, raw, torch.zeros_like(raw)), valid


def engram_hasher(cfg: ModelConfig, tokenizer: object | None) -> EngramHasher:
    """The hasher of `cfg` over `tokenizer`'s compressed map (default: the byte tokenizer of the vocab).
    The tokenizer is handed in by whoever loads the model (`weights.loader`); this module imports none."""
    from kvshare.model.engram_tokens import byte_token_map, compressed_token_map

    if tokenizer is None and cfg.vocab_size < 256:
        raise ConfigError(f"an Engram model needs a tokenizer; vocab_size {cfg.vocab_size} has no byte-level one",
                          field="engram_compressed_vocab_size", fix="pass the model's tokenizer")
    token_map = byte_token_map(cfg.vocab_size) if tokenizer is None else compressed_token_map(tokenizer)
    layout = EngramLayout.build(cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads,
                                cfg.engram_vocab_size, cfg.engram_compressed_vocab_size)
    try:
        return EngramHasher(layout, token_map, cfg.engram_compressed_vocab_size,
                            cfg.engram_pad_token_id, cfg.vocab_size)
    except ValueError as e:
        raise ConfigError(f"{e} (tokenizer: {type(tokenizer).__name__ if tokenizer is not None else 'byte-level'})", field="engram_compressed_vocab_size",
                          fix="load the model with its own tokenizer.json") from None
