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
which the others run batched as before. `per_row` does the same for acceptance (sampling or
speculative verification) row by row: it has no cache state, so a failed batch is simply redone
per row (a seeded row's generator may then have drawn twice in that step, so only a step that
failed loses that row's seed-for-seed reproducibility). Plain and speculative steps share both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Generic, TypeVar

from kvshare.engine.sequence import Sequence
from kvshare.engine.step_plan import ScheduledChunk

log = logging.getLogger(__name__)

R = TypeVar("R")


@dataclass
class IsolatedRun(Generic[R]):
    """What survived one step: each group that ran with its result, failures and requeues."""

    done: list[tuple[list[ScheduledChunk], R]] = field(default_factory=list)
    failed: list[tuple[Sequence, BaseException]] = field(default_factory=list)
    requeue: list[Sequence] = field(default_factory=list)


def run_isolated(run: Callable[[list[ScheduledChunk]], R], chunks: list[ScheduledChunk],
                 suspects: set[str]) -> IsolatedRun[R]:
    """Run `chunks` through `run` (one group at a time) so that one failing request cannot fail others.

    `suspects` (request ids) is updated in place: failed groups add theirs, solo successes clear.
    An exception with ``engine_fatal`` set (a lost tensor-parallel worker: no request's fault)
    propagates.
    """
    clean = [c for c in chunks if c.seq.request_id not in suspects]
    groups = ([clean] if clean else []) + [[c] for c in chunks if c.seq.request_id in suspects]
    out: IsolatedRun[R] = IsolatedRun()
    for group in groups:
        try:
            result = run(group)
        except Exception as e:  # noqa: BLE001 - any failure is contained to this group
            if getattr(e, "engine_fatal", False):
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
        out.done.append((group, result))
    return out


T = TypeVar("T")


def per_row(batch: Callable[[list[int]], list[T]], n: int) -> list[T | BaseException]:
    """``batch(rows)`` for all `n` rows at once; if that raises, row by row, each failure kept as
    its exception (the caller fails that request alone)."""
    try:
        return list(batch(list(range(n))))
    except Exception:  # noqa: BLE001 - find the row(s) at fault
        pass
    out: list[T | BaseException] = []
    for i in range(n):
        try:
            out.extend(batch([i]))
        except Exception as e:  # noqa: BLE001
            out.append(e)
    return out
