"""Engram n-gram hashing (spec/engram_dspark.md §1.4-§1.6): bucket layout, multipliers, hash ids.

For an Engram model with max n-gram size N, H hash heads and Engram layers ``l`` (ids in
`engram_layer_ids`), a token at absolute position p hashes the compressed ids of the raw tokens at
p, p-1, ..., p-N+1 into ``cols = (N-1) * H`` row ids per layer (column ``c = (n-2) * H + h`` holds
n-gram size n and head h):

* look-back: shift s is *blocked* when ``p - s < 0`` or any token at shifts ``0..s`` is DEAD (an
  image position); a blocked shift reads the compressed pad id ``token_map[engram_pad_token_id]``;
* ``rolling = tok[0] * mult[l][0]``; for i = 1..N-1: ``rolling ^= tok[i] * mult[l][i]``, then
  column ``(i-1)*H + h`` is ``rolling % primes[l][i-1][h] + offsets[l][(i-1)*H + h]``.

All arithmetic is int64 and non-negative: every compressed id is < C and every multiplier is at
most ``INT64_MAX // C``, so products never overflow. The primes of a layer partition its table:
column c owns rows ``[offset_c, offset_c + prime_c)``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from kvshare.config.engram import engram_primes

log = logging.getLogger(__name__)

INT64_MAX = 2**63 - 1

# Released multipliers of DeepSeek-V4.1-Flash (C = 99092, N = 4), per Engram layer id (spec §1.1).
# numpy does not promise its generator's stream across versions, so these are checked at build time.
V41_FLASH_MULTIPLIERS = {
    1: (76632096046245, 4839876093313, 35959672319349, 73987337458391),
    14: (67716810739261, 51510806800915, 30921347202721, 82619226485591),
}
V41_FLASH_COMPRESSED_VOCAB = 99092


def engram_multipliers(layer_ids: tuple[int, ...], max_ngram: int, compressed_vocab: int) -> np.ndarray:
    """Odd int64 multipliers [n_layers, N] (§1.5): ``2 * default_rng(10007 * layer_id).integers(0, bound) + 1``
    with ``bound = max(1, (INT64_MAX // C) // 2)``, C the compressed vocab size."""
    bound = max(1, (INT64_MAX // compressed_vocab) // 2)
    rows = [np.random.default_rng(10007 * lid).integers(0, bound, size=(max_ngram,), dtype=np.int64) * 2 + 1
            for lid in layer_ids]
    return np.stack(rows).astype(np.int64)


@dataclass(frozen=True)
class EngramLayout:
    """Bucket layout of every Engram layer: primes [L, cols], offsets [L, cols], rows per layer."""

    layer_ids: tuple[int, ...]
    max_ngram: int
    n_heads: int
    primes: torch.Tensor  # [L, cols] int64, column order (n-gram size major, then head)
    offsets: torch.Tensor  # [L, cols] int64, exclusive prefix sums of each layer's primes
    multipliers: torch.Tensor  # [L, N] int64

    @property
    def cols(self) -> int:
        return (self.max_ngram - 1) * self.n_heads

    @property
    def rows(self) -> tuple[int, ...]:
        """Rows each layer's table needs: the sum of its primes."""
        return tuple(int(r) for r in self.primes.sum(dim=1))

    @classmethod
    def build(cls, layer_ids: tuple[int, ...], max_ngram: int, n_heads: int, vocab_size: int,
              compressed_vocab: int) -> "EngramLayout":
        primes = torch.tensor(engram_primes(layer_ids, max_ngram, n_heads, vocab_size),
                              dtype=torch.int64).reshape(len(layer_ids), -1)
        offsets = torch.cumsum(primes, dim=1) - primes
        mult = torch.from_numpy(engram_multipliers(layer_ids, max_ngram, compressed_vocab))
        if compressed_vocab == V41_FLASH_COMPRESSED_VOCAB and max_ngram == 4:
            for i, lid in enumerate(layer_ids):
                if lid in V41_FLASH_MULTIPLIERS and tuple(mult[i].tolist()) != V41_FLASH_MULTIPLIERS[lid]:
                    log.warning("numpy %s does not reproduce the released Engram multipliers of layer %d; "
                                "using the released constants", np.__version__, lid)
                    mult[i] = torch.tensor(V41_FLASH_MULTIPLIERS[lid], dtype=torch.int64)
        return cls(tuple(layer_ids), max_ngram, n_heads, primes, offsets, mult)


def ngram_hash(tok: torch.Tensor, layout: EngramLayout) -> torch.Tensor:
    """Row ids [T, L, cols] int64 from compressed look-back ids ``tok`` [T, N] (shift 0 first,
    blocked shifts already replaced by the compressed pad id)."""
    t, n = tok.shape
    if n != layout.max_ngram:
        raise ValueError(f"look-back has {n} shifts, the layout needs engram_max_ngram_size={layout.max_ngram}")
    prod = tok.unsqueeze(1) * layout.multipliers.unsqueeze(0)  # [T, L, N]
    acc, sizes = prod[..., 0], []
    for i in range(1, n):  # one step per n-gram size (N - 1 of them), vectorised over tokens
        acc = acc ^ prod[..., i]
        sizes.append(acc)
    per_size = torch.stack(sizes, dim=-1).repeat_interleave(layout.n_heads, dim=-1)  # [T, L, cols]
    return per_size % layout.primes.unsqueeze(0) + layout.offsets.unsqueeze(0)


def compress_lookback(raw: torch.Tensor, valid: torch.Tensor, token_map: torch.Tensor, pad_id: int,
                      dead: torch.Tensor | None = None) -> torch.Tensor:
    """Compressed look-back ids [T, N] from raw ids [T, N] (shift s = column s) and their validity
    (position >= 0). Once a shift is blocked (invalid or DEAD) every older shift is blocked too."""
    blocked = ~valid
    if dead is not None:
        blocked = blocked | dead
    blocked = torch.cummax(blocked.to(torch.int8), dim=1).values.bool()
    safe = torch.where(blocked, torch.zeros_like(raw), raw)
    if safe.numel() and (int(safe.min()) < 0 or int(safe.max()) >= token_map.numel()):
        raise ValueError(f"token id outside the compressed token map (ids must be in [0, {token_map.numel()}))")
    return torch.where(blocked, torch.full_like(raw, pad_id), token_map[safe])


class EngramHasher:
    """Token ids -> Engram row ids for every Engram layer; holds the map and the layout (on CPU).

    `token_map` covers the tokenizer's ids; ids from there up to `vocab_size` (an embedding padded
    past the tokenizer) hash like the pad token. Its number of distinct values must equal
    `compressed_vocab`, else ValueError: every multiplier derives from that size.
    """

    def __init__(self, layout: EngramLayout, token_map: torch.Tensor, compressed_vocab: int, pad_token_id: int,
                 vocab_size: int) -> None:
        n_keys = int(token_map.max()) + 1 if token_map.numel() else 0
        if n_keys != compressed_vocab:
            raise ValueError(f"the tokenizer gives {n_keys} compressed token ids but engram_compressed_vocab_size "
                             f"is {compressed_vocab}: the tokenizer does not belong to this model (or the "
                             "`tokenizers` normaliser changed), and every Engram hash would be wrong")
        if not 0 <= pad_token_id < token_map.numel():
            raise ValueError(f"engram_pad_token_id {pad_token_id} is not a token of the tokenizer "
                             f"({token_map.numel()} tokens)")
        self.layout = layout
        self.pad_id = int(token_map[pad_token_id])
        full = torch.full((max(vocab_size, token_map.numel()),), self.pad_id, dtype=torch.int64)
        full[: token_map.numel()] = token_map
        self.token_map = full

    def __call__(self, raw: torch.Tensor, valid: torch.Tensor, dead: torch.Tensor | None = None) -> torch.Tensor:
        """Row ids [T, L, cols] from raw look-back ids [T, N] (shift s in column s) and validity [T, N]."""
        tok = compress_lookback(raw.cpu(), valid.cpu(), self.token_map, self.pad_id,
                                None if dead is None else dead.cpu())
        return ngram_hash(tok, self.layout)
