"""Block allocator, request slots and per-sequence block tables.

Addressing (spec/cache.md §2.4, §9.5): token position p of a sequence lives in its logical block
``p // block_size``. Compressed row j of an owner with ratio r covers positions ``[j*r, (j+1)*r)``
and lives in logical block ``(j*r) // block_size`` at row ``((j*r) % block_size) // r`` of that
owner's region; it is written only once its group completes (``(pos + 1) % r == 0``), so a
sequence of n computed tokens has ``n // r`` rows and needs ``ceil(n / block_size)`` blocks.

Invariants:

* Block 0 is the null block: never handed out, never freed; padding entries of a block table
  point at it, so a padded lookup reads a block nobody owns.
* A block with reference count 0 is either free or, when it holds a cached prefix block
  (``is_cached``), evictable: it stays matchable, in LRU order, until ``allocate`` runs out of free
  blocks and reclaims the least recently released one (``on_evict`` tells the prefix cache).
  ``num_free`` counts both, so admission sees every block it could get.
* -1 is never used as a tensor index (callers mask it before addressing).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

from kvshare.step.addresses import compressed_row_address  # noqa: F401  (the address rule, re-exported)

NULL_BLOCK = 0


class BlockAllocator:
    """Free list with reference counts over physical blocks ``1 .. num_blocks-1``."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 blocks (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        # Pop from the end: lowest ids are handed out first.
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))
        self._ref = [0] * num_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks with refcount 0, oldest first
        self.is_cached: Callable[[int], bool] = lambda block: False
        self.on_evict: Callable[[int], None] = lambda block: None

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: free ones plus evictable cached ones."""
        return len(self._free) + len(self._lru)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    def evictable(self) -> list[int]:
        """Evictable cached blocks, the next one `allocate` reclaims first."""
        return list(self._lru)

    @property
    def num_usable(self) -> int:
        """Blocks that can ever be handed out (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    def refcount(self, block: int) -> int:
        return self._ref[block]

    def allocate(self, n: int) -> list[int]:
        """Hand out n blocks with reference count 1; raises MemoryError if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            raise MemoryError(f"need {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                out.append(self._free.pop())
            else:
                b, _ = self._lru.popitem(last=False)
                self.on_evict(b)
                out.append(b)
        for b in out:
            self._ref[b] = 1
        return out

    def incref(self, block: int) -> None:
        """Share an allocated block (one more holder)."""
        if block == NULL_BLOCK or self._ref[block] <= 0:
            raise ValueError(f"block {block} is not allocated")
        self._ref[block] += 1

    def acquire(self, block: int) -> None:
        """Take one reference to a cached block, in use or evictable (a prefix-cache hit)."""
        if block == NULL_BLOCK or (self._ref[block] == 0 and block not in self._lru):
            raise ValueError(f"block {block} is neither allocated nor cached")
        self._lru.pop(block, None)
        self._ref[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block reaching 0 returns to the free list."""
        for b in blocks:
            if b == NULL_BLOCK:
                raise ValueError("the null block is never freed")
            if self._ref[b] <= 0:
                raise ValueError(f"double free of block {b}")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self.is_cached(b):
                    self._lru[b] = None
                else:
                    self._free.append(b)


class SlotAllocator:
    """Request slots ``0 .. num_slots-1`` (each indexes the per-slot rings and states)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise MemoryError("no free request slot")
        return self._free.pop()

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not allocated")
        self._free.append(slot)


class BlockManager:
    """Owns the allocator, the request slots and a per-slot block-table tensor.

    ``tables[slot, b]`` is the physical block of logical block b of the sequence in ``slot``
    (0 = null block for blocks not yet allocated). ``block_ids[slot]`` mirrors the allocated prefix.
    A step's block tables are ``tables[slots]``, one batched gather.
    """

    def __init__(self, num_blocks: int, block_size: int, num_slots: int, max_model_len: int,
                 device: torch.device | str = "cpu") -> None:
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.slots = SlotAllocator(num_slots)
        self.max_blocks_per_seq = blocks_for_tokens(max_model_len, block_size)
        self.tables = torch.zeros(num_slots, max(1, self.max_blocks_per_seq), dtype=torch.int64, device=device)
        self.block_ids: dict[int, list[int]] = {}
        self.on_open: Callable[[int], None] | None = None  # e.g. zero the slot's rings

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for_tokens(num_tokens, self.block_size)

    def extra_blocks(self, slot: int | None, num_tokens: int) -> int:
        """Blocks a sequence in `slot` (None: not admitted yet) must still get to hold num_tokens."""
        have = len(self.block_ids.get(slot, [])) if slot is not None else 0
        return max(0, self.blocks_needed(num_tokens) - have)

    def can_grow(self, slot: int | None, num_tokens: int) -> bool:
        return self.extra_blocks(slot, num_tokens) <= self.allocator.num_free

    def open_slot(self) -> int:
        slot = self.slots.allocate()
        self.block_ids[slot] = []
        if self.on_open is not None:
            self.on_open(slot)
        return slot

    def grow(self, slot: int, num_tokens: int) -> None:
        """Allocate blocks so the sequence in `slot` holds `num_tokens` positions."""
        n = self.extra_blocks(slot, num_tokens)
        if n == 0:
            return
        ids = self.block_ids[slot]
        if len(ids) + n > self.max_blocks_per_seq:
            raise ValueError(f"{num_tokens} tokens exceed max_model_len's {self.max_blocks_per_seq} blocks")
        new = self.allocator.allocate(n)
        self.tables[slot, len(ids):len(ids) + n] = torch.tensor(new, dtype=torch.int64).to(self.tables.device)
        ids.extend(new)

    def shrink(self, slot: int, num_tokens: int) -> None:
        """Free the slot's blocks past those holding `num_tokens` positions (speculative rollback)."""
        ids = self.block_ids[slot]
        keep = self.blocks_needed(num_tokens)
        if len(ids) > keep:
            self.allocator.free(ids[keep:])
            self.tables[slot, keep:len(ids)] = 0
            del ids[keep:]

    def adopt(self, slot: int, blocks: list[int]) -> None:
        """Put cached blocks (a prefix hit) at the start of an empty slot's table, one reference each."""
        if self.block_ids[slot]:
            raise ValueError(f"slot {slot} already holds blocks")
        if len(blocks) > self.max_blocks_per_seq:
            raise ValueError(f"{len(blocks)} blocks exceed max_model_len's {self.max_blocks_per_seq} blocks")
        for b in blocks:
            self.allocator.acquire(b)
        if blocks:
            self.tables[slot, :len(blocks)] = torch.tensor(blocks, dtype=torch.int64).to(self.tables.device)
        self.block_ids[slot] = list(blocks)

    def release(self, slot: int) -> None:
        """Free the slot's blocks and the slot itself (finish, abort or preemption).

        Tail first, so the LRU reclaims a sequence's last blocks before the prefix others share."""
        ids = self.block_ids.pop(slot)
        self.allocator.free(ids[::-1])
        self.tables[slot].zero_()
        self.slots.free(slot)


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
