"""A float64 engine runs the model, not a different function (issue 24, item 3).

In a float64 run every op is float64 except the roundings the model itself defines (FP8/FP4 cache
and activation formats when quantising). The engine's plain cache rows used to be bf16 for every
dtype but fp32, so a float64 engine rounded its KV, window and index-key rows to bf16 and drifted
4e-3 from its own fp32 run (and from the spec's reference), while every "float64 exactness" test
passed against itself. Here a float64 and an fp32 engine run the same random-weight model with
quantisation off: the chosen-token log-probabilities of greedy runs agree within 1e-5 (observed
at most 2.1e-6 on these configs; with bf16 rows, 1e-3 and different tokens). float64 DSpark
speculation also gives plain greedy on a V4.1 model with Engram and two draft stages.

Mutation caught: float64 plain rows back to "bf16" (or "fp32") in ``engine/cache_plan.build_layout``.
"""

from __future__ import annotations

import random

import pytest

from kvshare import LLM, SamplingParams
from kvshare.config import load_config
from kvshare.model.deepseek import Transformer
from kvshare.model.dspark import attach_dspark

TOKENS = 24
LOGPROB_TOL = 1e-5  # observed max |float64 - fp32| 1.4e-6 / 2.1e-6 / 1.9e-6 (tiny-v41, tiny-v4, tiny-v41-engram)


def _prompts(vocab: int, lens: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab - 1) for _ in range(n)] for n in lens]


def _greedy(model: Transformer, prompts: list[list[int]], **engine_args):
    llm = LLM(model, max_num_seqs=4, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, outs


@pytest.mark.parametrize("name", ["tiny-v41", "tiny-v4", "tiny-v41-engram"])
def test_float64_engine_agrees_with_fp32_engine(name: str) -> None:
    cfg = load_config(name)
    m32 = Transformer(cfg, quant=False).init_weights(3).eval()
    m64 = Transformer(cfg, quant=False).init_weights(3).eval().double()
    prompts = _prompts(cfg.vocab_size, [5, 17, 30, 9], seed=2)
    llm32, o32 = _greedy(m32, prompts)
    llm64, o64 = _greedy(m64, prompts)
    assert {f.name for f in (llm64.engine.layout.kv_format, llm64.engine.layout.window_format)} == {"fp64"}
    worst = 0.0
    for a, b in zip(o32, o64):
        assert a.token_ids == b.token_ids
        worst = max(worst, max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)))
    assert worst <= LOGPROB_TOL, worst


def test_float64_speculative_equals_plain_with_engram_and_two_draft_stages() -> None:
    cfg = load_config("tiny-v41-engram-dspark")
    assert cfg.num_nextn_predict_layers == 2 and cfg.engram_layer_ids
    model = Transformer(cfg, quant=False)
    attach_dspark(model)
    model = model.init_weights(1).double().eval()
    prompts = _prompts(cfg.vocab_size, [1, 6, 13, 21, 34, 8, 27, 3], seed=7)
    _, plain = _greedy(model, prompts)
    llm, spec = _greedy(model, prompts, speculative_config={"method": "dspark", "num_speculative_tokens": 4})
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert llm.engine.stats().extra["spec_num_verifies"] > 0
