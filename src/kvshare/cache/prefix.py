"""Exact prefix caching: content-addressed full blocks plus boundary checkpoints.

Blocks. Only full blocks of B committed tokens are hashed. The hash of logical block k chains over
its parent's hash, the block's token ids and a key (``prefix_key``: model, layout, dtype, B, window)
plus the request's ``cache_salt``, so requests with different salts never share a block. A table
maps hash -> (physical block, token ids); a hit compares the token ids, so a hash collision can
never hand one prompt another prompt's rows.

Checkpoints. A block hit restores every layer's compressed and index-K reads (owner regions ride in
the blocks; sharing layers alias them), but not the per-request rings: the last W-1 window rows of
every layer and the compressor carry rows. A checkpoint is exactly those ring rows at a block
boundary H, keyed by the hash of the block that ends at H. A hit is adopted only at the deepest
boundary of the matched chain that has a checkpoint, so a hit restores bitwise the state a cold run
holds at H. Nothing is replayed or approximated.

Eviction. Blocks are reference counted by the BlockAllocator; a freed block that carries a hash stays
matchable until the allocator's LRU reclaims it (``drop_block``). Checkpoints have their own byte
budget and LRU. Dropping a block drops every checkpoint whose chain runs through it (they could never
be reached again); dropping a checkpoint never touches blocks.

Invariants: ``table[h].tokens`` are the token ids the block was computed from; every checkpoint's
chain hashes were in the table when it was inserted and it is dropped when any of them leaves;
``checkpoint_bytes <= budget`` after every insert.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch

HASH_BYTES = 16


def prefix_key(*parts: object) -> bytes:
    """Digest of what makes two blocks byte-compatible (model, layout, dtype, block size, window...)."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=HASH_BYTES).digest()


def block_hash(parent: bytes | None, tokens: list[int], key: bytes, salt: str | None) -> bytes:
    """Chained hash of one full block: parent hash, token ids, the cache key and the salt."""
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(parent or b"\0" * HASH_BYTES)
    h.update(key)
    h.update(b"" if salt is None else b"salt:" + salt.encode())
    h.update(array("q", tokens).tobytes())
    return h.digest()


@dataclass
class CachedBlock:
    block: int
    tokens: tuple[int, ...]
    salt: str | None = None


@dataclass
class Checkpoint:
    """Ring rows at boundary H: ``rings[(name, layer)] = (depth, width, rows [k, row_bytes])``.

    Row i of ``rows`` is position ``H - k + i`` (zeros for positions < 0)."""

    boundary: int
    chain: tuple[bytes, ...]
    rings: dict[tuple[str, int], tuple[int, int, torch.Tensor]]
    nbytes: int = 0

    def __post_init__(self) -> None:
        self.nbytes = sum(r.numel() * r.element_size() for _, _, r in self.rings.values())


@dataclass
class Match:
    """What a lookup found: the hit boundary, its blocks, and how deep the block chain alone reached."""

    boundary: int  # tokens restored (0: no hit)
    blocks: list[int]  # physical blocks of [0, boundary)
    hashes: list[bytes]  # hashes of those blocks
    block_depth: int  # tokens covered by matching blocks (>= boundary)
    checkpoint: Checkpoint | None = None


@dataclass
class PrefixStats:
    queried_tokens: int = 0
    hit_tokens: int = 0
    checkpoints_evicted: int = 0
    blocks_evicted: int = 0


class PrefixCache:
    """Block hash table with a token check, and the checkpoint store (byte budget, LRU, cascade)."""

    def __init__(self, block_size: int, key: bytes, checkpoint_budget: int) -> None:
        if checkpoint_budget < 0:
            raise ValueError(f"checkpoint budget must be >= 0 bytes, got {checkpoint_budget}")
        self.block_size = block_size
        self.key = key
        self.budget = checkpoint_budget
        self.table: dict[bytes, CachedBlock] = {}
        self.hash_of_block: dict[int, bytes] = {}
        self.checkpoints: OrderedDict[bytes, Checkpoint] = OrderedDict()  # oldest first
        self._dependents: dict[bytes, set[bytes]] = {}  # block hash -> checkpoints through it
        self.checkpoint_bytes = 0
        self.stats = PrefixStats()

    # ---- hashing ---------------------------------------------------------------------------------
    def hashes(self, tokens: list[int], known: list[bytes], n_blocks: int, salt: str | None) -> list[bytes]:
        """Extend `known` (the hashes of a sequence's first blocks) to `n_blocks` blocks, in place;
        `tokens` are the sequence's tokens from block ``len(known)`` on."""
        b, first = self.block_size, len(known)
        for k in range(first, n_blocks):
            off = (k - first) * b
            known.append(block_hash(known[-1] if known else None, tokens[off:off + b], self.key, salt))
        return known

    # ---- blocks ------------------------------------------------------------------------------------
    def register(self, h: bytes, block: int, tokens: list[int], salt: str | None = None) -> bool:
        """Make `block` the cached copy of hash `h` unless one already is; True if registered."""
        if h in self.table or block in self.hash_of_block:
            return False
        self.table[h] = CachedBlock(block, tuple(tokens), salt)
        self.hash_of_block[block] = h
        return True

    def is_cached(self, block: int) -> bool:
        return block in self.hash_of_block

    def drop_block(self, block: int) -> None:
        """The allocator reclaims `block`: forget its hash and every checkpoint deeper in its chain."""
        h = self.hash_of_block.pop(block, None)
        if h is None:
            return
        del self.table[h]
        self.stats.blocks_evicted += 1
        for ck in list(self._dependents.pop(h, ())):
            self._drop_checkpoint(ck)

    def lookup(self, tokens: list[int], hashes: list[bytes], max_tokens: int, salt: str | None = None) -> Match:
        """Longest chain of cached blocks over `tokens[:max_tokens]` (token ids and salt checked from
        block 0 on), and the deepest checkpoint on it. `hashes` must cover ``max_tokens // B`` blocks."""
        b = self.block_size
        blocks: list[int] = []
        for k in range(max_tokens // b):
            e = self.table.get(hashes[k])
            if e is None or e.salt != salt or e.tokens != tuple(tokens[k * b:(k + 1) * b]):
                break  # a miss, or a hash collision the token / salt check rejects
            blocks.append(e.block)
        for k in range(len(blocks), 0, -1):
            ck = self.checkpoints.get(hashes[k - 1])
            if ck is not None:
                self.checkpoints.move_to_end(hashes[k - 1])
                return Match(k * b, blocks[:k], hashes[:k], len(blocks) * b, ck)
        return Match(0, [], [], len(blocks) * b)

    # ---- checkpoints -----------------------------------------------------------------------------
    def has_checkpoint(self, h: bytes) -> bool:
        return h in self.checkpoints

    def insert_checkpoint(self, ck: Checkpoint) -> bool:
        """Store `ck` under its last chain hash, evicting LRU checkpoints to fit the budget.

        Refused (False) when a chain block is not cached or the checkpoint alone exceeds the budget."""
        key = ck.chain[-1]
        if key in self.checkpoints or ck.nbytes > self.budget or any(h not in self.table for h in ck.chain):
            return False
        while self.checkpoint_bytes + ck.nbytes > self.budget:
            self._drop_checkpoint(next(iter(self.checkpoints)))
            self.stats.checkpoints_evicted += 1
        self.checkpoints[key] = ck
        self.checkpoint_bytes += ck.nbytes
        for h in ck.chain:
            self._dependents.setdefault(h, set()).add(key)
        return True

    def _drop_checkpoint(self, key: bytes) -> None:
        ck = self.checkpoints.pop(key, None)
        if ck is None:
            return
        self.checkpoint_bytes -= ck.nbytes
        for h in ck.chain:
            deps = self._dependents.get(h)
            if deps is not None:
                deps.discard(key)
                if not deps:
                    del self._dependents[h]
