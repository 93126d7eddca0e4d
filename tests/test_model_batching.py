"""Batching: sequences of different lengths in one ragged StepBatch equal running them alone.

Steps mix prefill chunks and decode tokens of two sequences in non-adjacent cache slots, and one
step lists the sequences in the other order (float64 so that batch-shape noise cannot flip an
FP8/FP4 rounding or a top-k; quantisation off and on).
"""

from __future__ import annotations

import pytest
import torch

from kvshare.cache.dense import DenseCache
from kvshare.step import StepBatch
from test_model_common import (
    MAX_LEN, assert_close, make_model, run_chunks, token_ids,
)

pytestmark = pytest.mark.usefixtures("small_prefill_paths")  # prefill runs its fast paths


CONFIGS = ["tiny-v41", "tiny-v41-deep", "cand"]


@pytest.mark.parametrize("quant", [False, True], ids=["plain", "quant"])
@pytest.mark.parametrize("name", CONFIGS)
def test_batched_sequences_equal_alone(name: str, quant: bool) -> None:
    model = make_model(name, quant).double()
    a, b = token_ids(model.cfg, 30, seed=11), token_ids(model.cfg, 17, seed=12)
    alone_a = run_chunks(model, a, [21, 1, 1, 7])
    alone_b = run_chunks(model, b, [9, 5, 1, 2])
    cache = DenseCache(model.cfg, model.topo, 3, MAX_LEN, dtype=torch.float64)
    got_a, got_b = [], []
    # Step shapes: (a 0..21, b 0..9), (a 21, b 9..14), (b 14, a 22), (a 23..30, b 15..17); slots 2 and 0.
    steps = [((0, 21), (0, 9)), ((21, 1), (9, 5)), ((22, 1), (14, 1)), ((23, 7), (15, 2))]
    with torch.no_grad():
        for i, ((sa, na), (sb, nb)) in enumerate(steps):
            if i == 2:  # b first in this step
                batch = StepBatch.build([sb, sa], [nb, na], [0, 2])
                ids = torch.cat([b[sb:sb + nb], a[sa:sa + na]])
                out = model(ids, batch, cache)
                got_b.append(out[:nb]); got_a.append(out[nb:])
            else:
                batch = StepBatch.build([sa, sb], [na, nb], [2, 0])
                out = model(torch.cat([a[sa:sa + na], b[sb:sb + nb]]), batch, cache)
                got_a.append(out[:na]); got_b.append(out[na:])
    assert_close(torch.cat(got_a), alone_a, what="sequence a batched vs alone")
    assert_close(torch.cat(got_b), alone_b, what="sequence b batched vs alone")
