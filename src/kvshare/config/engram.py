"""Engram config rules (spec/engram_dspark.md §1.12), checked when a ModelConfig is built.

With `engram_layer_ids` empty every other `engram_*` field is ignored. Otherwise:
V4.1 only; one table size per layer; layer ids distinct and inside the backbone; max n-gram >= 2;
heads > 0; head_dim a positive multiple of 32 (one FP8 row scale per 32 columns); a positive
prime-search start and compressed vocabulary; a pad id inside the vocabulary; and each layer's
table size equal to the sum of its primes (§1.4), since the hash addresses exactly those rows.
The tokenizer-built compressed vocabulary is checked when the model gets its tokenizer
(`EngramHasher`), not here.
"""

from __future__ import annotations

from typing import Any

from kvshare.errors import ConfigError

#: `config.model.ModelConfig`, which imports this module: named, not imported (no import cycle, even type-only)
ModelConfig = Any

ROW_SCALE_BLOCK = 32
MAX_HASH_COLUMNS = 1 << 16  # primes searched at config time; the release has 48
MAX_BUCKET_START = 1 << 40  # bucket ids stay far inside int64


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24 (these bases are exact for every 64-bit n)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in small:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(layer_ids: tuple[int, ...], max_ngram: int, n_heads: int, vocab_size: int) -> list[list[list[int]]]:
    """primes[layer index][n - 2][head] (§1.4): per (layer, n) the search restarts at
    ``vocab_size - 1`` and takes the next primes not used by any earlier (layer, n, head)."""
    seen: set[int] = set()
    out: list[list[list[int]]] = []
    for _ in layer_ids:
        per_layer = []
        for _n in range(2, max_ngram + 1):
            current, heads = vocab_size - 1, []
            for _h in range(n_heads):
                current += 1
                while not is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                heads.append(current)
            per_layer.append(heads)
        out.append(per_layer)
    return out


def validate_engram(cfg: ModelConfig) -> None:
    """Raise ConfigError naming the `engram_*` field (and layer) of the first rule `cfg` breaks."""
    ids = cfg.engram_layer_ids
    if not ids:
        return
    if cfg.arch != "v41":
        raise ConfigError("Engram exists only in V4.1 models", field="engram_layer_ids",
                          fix="remove engram_layer_ids or use model_type deepseek_v41")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{list(ids)} repeats a layer", field="engram_layer_ids", fix="list each layer once")
    for lid in ids:
        if not 0 <= lid < cfg.num_hidden_layers:
            raise ConfigError(f"layer {lid} is not a backbone layer (0..{cfg.num_hidden_layers - 1})",
                              field="engram_layer_ids", layer=lid, fix="use backbone layer ids")
    if len(cfg.engram_num_embeddings) != len(ids):
        raise ConfigError(f"has {len(cfg.engram_num_embeddings)} entries for {len(ids)} Engram layers",
                          field="engram_num_embeddings", fix="give one table size per entry of engram_layer_ids")
    checks = (
        ("engram_max_ngram_size", cfg.engram_max_ngram_size >= 2, "must be at least 2 (bigrams and longer)"),
        ("engram_n_heads", cfg.engram_n_heads > 0, "must be positive"),
        ("engram_head_dim", cfg.engram_head_dim > 0 and cfg.engram_head_dim % ROW_SCALE_BLOCK == 0,
         f"must be a positive multiple of {ROW_SCALE_BLOCK} (one FP8 row scale per {ROW_SCALE_BLOCK} columns)"),
        ("engram_vocab_size", cfg.engram_vocab_size >= 1, "must be positive (the prime search starts at it)"),
        ("engram_compressed_vocab_size", cfg.engram_compressed_vocab_size >= 1,
         "must be positive (the size of the normalised token space)"),
        ("engram_pad_token_id", 0 <= cfg.engram_pad_token_id < cfg.vocab_size, f"must be a token id < {cfg.vocab_size}"),
    )
    for name, ok, rule in checks:
        if not ok:
            raise ConfigError(f"{rule}, got {getattr(cfg, name)!r}", field=name, fix="set it as the model's config.json does")
    n_primes = len(ids) * (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    if n_primes > MAX_HASH_COLUMNS or cfg.engram_vocab_size > MAX_BUCKET_START or cfg.engram_head_dim > 4096:
        raise ConfigError(f"{n_primes:,} hash columns of {cfg.engram_head_dim} from {cfg.engram_vocab_size:,} are far "
                          "beyond any real model (V4.1-Flash: 48 columns of 256 from 16,000,000)",
                          field="engram_n_heads", fix="check engram_n_heads, engram_max_ngram_size, "
                                                     "engram_head_dim and engram_vocab_size")
    primes = engram_primes(ids, cfg.engram_max_ngram_size, cfg.engram_n_heads, cfg.engram_vocab_size)
    for lid, rows, per_layer in zip(ids, cfg.engram_num_embeddings, primes):
        need = sum(sum(p) for p in per_layer)
        if rows != need:
            raise ConfigError(f"layer {lid} has {rows} rows but its {len(per_layer) * cfg.engram_n_heads} hash "
                              f"primes sum to {need}", field="engram_num_embeddings", layer=lid,
                              fix=f"set it to {need} (or fix engram_vocab_size / n_heads / max_ngram_size)")


RANDOM_TABLE_LIMIT = 1 << 30


def engram_bytes(cfg: ModelConfig) -> dict[str, int]:
    """Bytes of the Engram tensors in their released dtypes (spec §1.2), summed over Engram layers:
    ``tables`` (FP8 rows + e8m0 row scales; host-resident) and ``dense`` (FP8 `wkv` + its 32x32 block
    scales, bf16 `q_weight` / `k_weight`; beside the model's other weights)."""
    if not cfg.engram_layer_ids:
        return {"tables": 0, "dense": 0}
    d_e, blk = cfg.engram_head_dim, cfg.act_quant_block
    rows = sum(cfg.engram_num_embeddings)
    tables = rows * d_e + rows * (d_e // ROW_SCALE_BLOCK)
    w_in = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * d_e
    w_out = (cfg.hc_mult + 1) * cfg.hidden_size
    per_layer = w_in * w_out + (-(-w_out // blk)) * (-(-w_in // blk)) + 2 * cfg.hc_mult * cfg.hidden_size * 2
    return {"tables": tables, "dense": per_layer * len(cfg.engram_layer_ids)}


def check_random_tables(cfg: ModelConfig, name: str) -> None:
    """ConfigError when `cfg`'s Engram tables are too large to fill with random values (no weights)."""
    n = engram_bytes(cfg)["tables"]
    if n > RANDOM_TABLE_LIMIT:
        raise ConfigError(f"{name} has no weights, and its Engram tables ({n:,} B, {n / 2**30:.2f} GiB) are too "
                          "large to fill with random values", field="engram_num_embeddings",
                          fix="pass a checkpoint directory holding the released weights (config.json, "
                              "*.safetensors, tokenizer.json)")


def engram_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The Engram tensors of the model's state dict (released names; the tables are not among them)."""
    w_in = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * cfg.engram_head_dim
    hc, d = cfg.hc_mult, cfg.hidden_size
    out: dict[str, tuple[int, ...]] = {}
    for lid in cfg.engram_layer_ids:
        p = f"layers.{lid}.engram."
        out.update({p + "wkv.weight": ((hc + 1) * d, w_in), p + "q_weight": (hc, d), p + "k_weight": (hc, d)})
    return out
