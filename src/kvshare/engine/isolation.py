"""Per-request failure isolation inside one engine step.

A batched forward that raises says nothing about which request caused it, and a forward that
failed half-way may have written some layers' cache rows and rings, so none of its sequences
can simply be run again. `run_isolated` therefore:

1. runs the scheduled chunks of sequences not under suspicion as one batch, and every suspect's
   chunk alone;
2. when a group of several fails, requeues its sequences (cache state dropped, recomputed from
   their tokens later, so their outputs are unchanged) and marks them suspects;
3. when a group of one fails, that request is the culprit: it is reported failed.

A suspect that completes a step alone is cleared and batches normally again. A poisoned request
among N therefore costs one failed batch and one step of N single-sequence forwards, after
which the others run batched as before. `sample_isolated` does the same for the sampler, row by
row (sampling has no cache state, so a failed batch is simply redone per row; a seeded row's
generator may then have drawn twice in that step, so only a step that failed loses that row's
seed-for-seed reproducibility).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kvshare.engine.scheduler import ScheduledChunk
from kvshare.engine.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass
class IsolatedRun:
    """What survived one step: chunks that ran, their sampling logits, failures and requeues."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    logits: torch.Tensor | None = None  # [len(sampling), vocab]
    sampling: list[int] = field(default_factory=list)  # indices into `chunks`
    failed: list[tuple[Sequence, BaseException]] = field(default_factory=list)
    requeue: list[Sequence] = field(default_factory=list)


def run_isolated(run: Callable[[list[ScheduledChunk]], tuple[torch.Tensor, list[int]]],
                 chunks: list[ScheduledChunk], suspects: set[str]) -> IsolatedRun:
    """Run `chunks` through `run` (ModelRunner.run) so that one failing request cannot fail others.

    `suspects` (request ids) is updated in place: failed groups add theirs, solo successes clear.
    """
    clean = [c for c in chunks if c.seq.request_id not in suspects]
    groups = ([clean] if clean else []) + [[c] for c in chunks if c.seq.request_id in suspects]
    out = IsolatedRun()
    rows: list[torch.Tensor] = []
    for group in groups:
        try:
            logits, sampling = run(group)
        except Exception as e:  # noqa: BLE001 - any failure is contained to this group
            if getattr(e, "engine_fatal", False):  # e.g. a lost tensor-parallel worker: no request's fault
                raise
            if len(group) == 1:
                suspects.discard(group[0].seq.request_id)
                out.failed.append((group[0].seq, e))
            else:
                log.warning("a batched step of %d requests failed (%s: %s); rerunning them one by one",
                            len(group), type(e).__name__, e)
                out.requeue.extend(c.seq for c in group)
                suspects.update(c.seq.request_id for c in group)
            continue
        if len(group) == 1:
            suspects.discard(group[0].seq.request_id)
        base = len(out.chunks)
        out.chunks.extend(group)
        out.sampling.extend(base + i for i in sampling)
        rows.append(logits)
    if rows:
        out.logits = rows[0] if len(rows) == 1 else torch.cat(rows)
    return out


def sample_isolated(sample: Callable[..., tuple[torch.Tensor, torch.Tensor]], logits: torch.Tensor,
                    params: list[Any], request_ids: list[str],
                    histories: list[Any] | None = None) -> list[tuple[int, float] | BaseException]:
    """Sample all rows at once; if that raises, row by row. Returns per row (token, logprob) or the error.

    `histories` (each row's prompt and output ids, for penalties) is passed on, sliced like the rows."""
    try:
        tokens, logprobs = sample(logits, params, request_ids, histories)
        return list(zip(tokens.tolist(), logprobs.tolist()))
    except Exception:  # noqa: BLE001 - find the row(s) at fault
        pass
    results: list[tuple[int, float] | BaseException] = []
    for i in range(len(params)):
        try:
            t, lp = sample(logits[i:i + 1], params[i:i + 1], request_ids[i:i + 1],
                           None if histories is None else histories[i:i + 1])
            results.append((int(t[0]), float(lp[0])))
        except Exception as e:  # noqa: BLE001
            results.append(e)
    return results
