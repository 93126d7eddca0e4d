"""One timed greedy generation, the same record for kvshare and for the transformers peer.

``GenResult`` keeps what the report needs: the generated tokens (to check they are identical),
the prefill time (prompt in, first token of every sequence out), each decode step's wall time,
and the peak memory of the run. Throughputs are derived: prefill tokens/s = B * L / prefill_s,
decode tokens/s = B / median step, time per output token = median step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from kvshare.bench.measure import StepTimes


@dataclass
class GenResult:
    """A timed greedy generation of `batch` equal-length prompts."""

    engine: str
    batch: int
    prompt_len: int
    tokens: list[list[int]]
    prefill_s: float
    decode: StepTimes = field(default_factory=StepTimes)
    memory: dict[str, Any] = field(default_factory=dict)

    @property
    def prefill_tps(self) -> float:
        return self.batch * self.prompt_len / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tps(self) -> float:
        m = self.decode.median
        return self.batch / m if m > 0 else float("nan")

    @property
    def tpot_ms(self) -> float:
        return self.decode.median * 1e3

    def as_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "batch": self.batch, "prompt_len": self.prompt_len,
                "new_tokens": len(self.tokens[0]) if self.tokens else 0,
                "prefill_s": self.prefill_s, "prefill_tok_s": self.prefill_tps,
                "decode_tok_s": self.decode_tps, "tpot_ms": self.tpot_ms,
                "decode_steps": self.decode.as_dict(), "memory": self.memory}


def best_of(runs: list[GenResult]) -> GenResult:
    """The fastest decode run, with the fastest prefill time of all runs (each measure's best)."""
    best = max(runs, key=lambda r: r.decode_tps)
    return dataclasses.replace(best, prefill_s=min(r.prefill_s for r in runs))


def equal_length_prompts(batch: int, length: int, vocab: int, seed: int, avoid: tuple[int, ...] = ()) -> torch.Tensor:
    """`batch` random prompts of `length` token ids in [3, vocab), never an id in `avoid`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    for a in avoid:
        ids[ids == a] = 3 if a != 3 else 4
    return ids


def compare_tokens(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """Whether two runs generated identical tokens; else how many sequences match and where the first differs."""
    same = [x == y for x, y in zip(a, b)]
    first_diff = []
    for x, y in zip(a, b):
        d = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None)
        if d is None and len(x) != len(y):
            d = min(len(x), len(y))
        first_diff.append(d)
    return {"identical": all(same) and len(a) == len(b), "sequences_identical": sum(same),
            "sequences": len(a), "first_divergence": first_diff}
