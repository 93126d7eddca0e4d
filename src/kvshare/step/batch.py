"""StepBatch: the ragged batch of sequence chunks one forward step computes.

A forward step processes a flat, ragged batch of T tokens from N sequences; sequence i contributes
the consecutive positions ``[starts[i], starts[i] + lens[i])`` (a prefill chunk, a whole prompt, or
one decode token). Tokens of one sequence are contiguous and in position order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvshare.step.addresses import StepAddresses


@dataclass
class StepBatch:
    """A ragged batch of sequence chunks.

    Invariants: ``positions[cu_seqlens[i]:cu_seqlens[i+1]] == arange(starts[i], starts[i]+lens[i])``;
    ``seq_index[t]`` is the sequence (0..N-1) of token t; ``slots[i]`` is the request slot whose
    rings and states hold sequence i's history (prior positions ``< starts[i]``).
    ``block_tables`` (paged backend only) maps sequence i's logical block b to a physical block.
    ``logit_rows`` are the token rows whose logits the caller needs (None: every row).
    ``prev_tokens`` [N, K] holds each sequence's token ids at positions ``starts[i] - K ..
    starts[i] - 1`` (oldest first; columns before position 0 are padding); Engram hashes a chunk's
    first tokens with them. Only needed when a chunk starts after position 0 and the model has Engram.
    """

    positions: torch.Tensor  # [T] int64
    seq_index: torch.Tensor  # [T] int64
    cu_seqlens: torch.Tensor  # [N+1] int64
    starts: torch.Tensor  # [N] int64
    lens: torch.Tensor  # [N] int64
    slots: torch.Tensor  # [N] int64
    block_tables: torch.Tensor | None = None  # [N, max_blocks] int64, 0 = null block
    logit_rows: torch.Tensor | None = None  # [R] int64
    prev_tokens: torch.Tensor | None = None  # [N, K] int64
    # (starts, lens, slots) as host ints when known (``build``): addresses need no device read
    host: tuple[list[int], list[int], list[int]] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    @property
    def num_seqs(self) -> int:
        return int(self.lens.numel())

    @property
    def ends(self) -> torch.Tensor:
        return self.starts + self.lens

    def host_lists(self) -> tuple[list[int], list[int], list[int]]:
        """(starts, lens, slots) as Python ints: ``host`` when the batch was built from host lists,
        else read from the tensors once (one device read per step, outside the layers)."""
        if self.host is None:
            self.host = (self.starts.tolist(), self.lens.tolist(), self.slots.tolist())
        return self.host

    def __getstate__(self) -> dict:
        """Pickled without its addresses (tensor parallelism sends batches; a receiver builds its own)."""
        return {k: v for k, v in self.__dict__.items() if k != "_addresses"}

    def addresses(self) -> "StepAddresses":
        """This step's `StepAddresses`, built on first use and kept with the batch (a batch moved
        to another device by ``dataclasses.replace`` builds its own)."""
        addr = self.__dict__.get("_addresses")
        if addr is None or addr.batch is not self:
            addr = StepAddresses(self)
            self.__dict__["_addresses"] = addr
        return addr

    @classmethod
    def build(
        cls,
        starts: list[int],
        lens: list[int],
        slots: list[int] | None = None,
        *,
        block_tables: torch.Tensor | None = None,
        logit_rows: list[int] | torch.Tensor | None = None,
        device: torch.device | str = "cpu",
        prev_tokens: list[list[int]] | torch.Tensor | None = None,
    ) -> "StepBatch":
        """Build the index tensors from per-sequence chunk starts and lengths.

        `prev_tokens` as lists: sequence i's ids just before its chunk, at most K of them (fewer
        only when the chunk starts before position K); they are left-padded to [N, K]."""
        if len(starts) != len(lens) or not lens or min(lens) <= 0:
            raise ValueError("every sequence in a step needs a chunk of at least one token")
        n = len(lens)
        lens_h = np.asarray(lens, dtype=np.int64)
        cu_h = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lens_h, out=cu_h[1:])
        seq_h = np.repeat(np.arange(n, dtype=np.int64), lens_h)
        pos_h = np.arange(int(cu_h[-1]), dtype=np.int64) - cu_h[:-1][seq_h] + np.asarray(starts, dtype=np.int64)[seq_h]
        flat = torch.from_numpy(np.concatenate([pos_h, seq_h, cu_h, np.asarray(starts, dtype=np.int64), lens_h]))
        positions, seq_index, cu, starts_t, lens_t = flat.to(device).split([len(pos_h), len(pos_h), n + 1, n, n])
        slots_t = torch.tensor(slots if slots is not None else list(range(n)), dtype=torch.int64, device=device)
        lr = None
        if logit_rows is not None:
            lr = torch.as_tensor(logit_rows, dtype=torch.int64, device=device)
        prev = None
        if isinstance(prev_tokens, torch.Tensor):
            prev = prev_tokens.to(device=device, dtype=torch.int64)
        elif prev_tokens is not None:
            k = max((len(p) for p in prev_tokens), default=0)
            for i, p in enumerate(prev_tokens):
                if len(p) != min(k, starts[i]):
                    raise ValueError(f"sequence {i}: {len(p)} previous tokens for a chunk at position {starts[i]} "
                                     f"(expected {min(k, starts[i])})")
            prev = torch.tensor([[0] * (k - len(p)) + list(p) for p in prev_tokens], dtype=torch.int64,
                                device=device).reshape(n, k)
        host = (list(starts), list(lens), list(slots) if slots is not None else list(range(n)))
        return cls(positions, seq_index, cu, starts_t, lens_t, slots_t, block_tables, lr, prev, host)
