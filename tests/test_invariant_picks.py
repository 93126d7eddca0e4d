"""Batch-invariant attention on top-k layers reads only the pick columns a row can fill.

A row at position p picks at most its causal compressed count ``(p + 1) // ratio`` entries, listed
first (ops/topk.py), so rows whose length bucket b is below ``index_topk`` k gather min(b, k) columns
instead of k (`PagedAttention._rows`; prefill at released sizes was 8x slower than the batched
path before, from gathering k mostly-empty rows per query). Checked against the batched engine
(per-sequence `prefix_attention`, a different code path) in float64, with k = 96 > BUCKET = 64 so
rows fall in buckets of 64 (trimmed) and 128 (all k columns): every prompt token's log-probability
and the greedy continuations agree within 1e-9 (observed: identical, the float64 logits' differences
vanish in the sampler's fp32 log-softmax). Mutation caught: ``min(b, k) - 1`` columns (a row drops
its last pick: 42 calls of widths 64 and 96 run here).
"""

from __future__ import annotations

import dataclasses
import random


from kvshare import LLM, SamplingParams
from kvshare.config import load_config
from kvshare.model.deepseek import Transformer
from kvshare.ops import invariant

TOL = 1e-9


def _run(model: Transformer, prompts: list[list[int]], batch_invariant: bool):
    llm = LLM(model, max_num_seqs=4, batch_invariant=batch_invariant, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=True, prompt_logprobs=0)
    return llm.generate(prompts, params, use_tqdm=False)


def test_trimmed_pick_columns_match_the_batched_path_in_float64() -> None:
    cfg = dataclasses.replace(load_config("tiny-v4"), index_topk=96)
    assert invariant.BUCKET < cfg.index_topk < 2 * invariant.BUCKET
    model = Transformer(cfg, quant=False).init_weights(5).eval().double()
    rng = random.Random(1)
    prompts = [[rng.randrange(cfg.vocab_size - 1) for _ in range(n)] for n in (300, 460, 40)]
    got, want = _run(model, prompts, True), _run(model, prompts, False)
    worst = 0.0
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        pairs = list(zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])) + list(zip(a.logprobs, b.logprobs))
        worst = max(worst, max(abs(x - y) for x, y in pairs))
    assert worst <= TOL, worst
