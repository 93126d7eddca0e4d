"""Log-probabilities from the engine (sampled tokens, their top-k, prompts) against a hand formula.

The reference: one dense forward (Transformer + DenseCache, no paging, no chunking) of the whole
prompt + output with a logits row at every position, then log_softmax written out in float64
(``x - max - log(sum(exp(x - max)))``). The engine runs the same tokens paged, chunked (a small
token budget splits the prompt), batched with another request, with prefix caching on.
Observed max |diff| (fp32 weights): 1.7e-6 (prompt and output logprobs); tolerance 1e-5.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvshare.config import load_config
from kvshare.engine.engine import LLMEngine
from kvshare.engine.sampling import SamplingParams
from kvshare.model.deepseek import Transformer
from kvshare.cache.dense import DenseCache
from kvshare.step import StepBatch

TOL = 1e-5
K = 4


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer(load_config("tiny-v41"), quant=False).init_weights(3).eval()


def hand_logprobs(model: Transformer, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V] float64: row p = log-probabilities of the token after position p."""
    cache = DenseCache(model.cfg, model.topo, 1, len(tokens) + 1)
    batch = StepBatch.build([0], [len(tokens)], [0], logit_rows=list(range(len(tokens))))
    with torch.inference_mode():
        x = model(torch.tensor(tokens), batch, cache).double()
    m = x.max(dim=-1, keepdim=True).values
    return x - m - (x - m).exp().sum(dim=-1, keepdim=True).log()


def run(eng: LLMEngine, reqs: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (prompt, p) in reqs.items():
        eng.add_request(rid, prompt, p)
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    return done


def test_prompt_and_sampled_logprobs_match_hand_log_softmax(model: Transformer) -> None:
    rng = random.Random(5)
    prompt = [rng.randrange(256) for _ in range(29)]
    other = [rng.randrange(256) for _ in range(11)]
    eng = LLMEngine(model, max_num_batched_tokens=7, block_size=8, num_blocks=24, max_num_seqs=4)
    p = SamplingParams(temperature=0.9, seed=3, max_tokens=5, ignore_eos=True, logprobs=K, prompt_logprobs=K)
    # the same prompt twice: the second would hit the prefix cache, but prompt logprobs need every row
    out = run(eng, {"a": (prompt, p), "b": (other, SamplingParams(temperature=0, max_tokens=3))})
    out2 = run(eng, {"c": (prompt, p)})
    for o in (out["a"], out2["c"]):
        ref = hand_logprobs(model, prompt + o.token_ids)
        n = len(prompt)
        assert o.prompt_logprobs[0] is None and o.prompt_top_logprobs[0] is None
        worst = 0.0
        for pos in range(1, n):
            lp = ref[pos - 1]
            worst = max(worst, abs(o.prompt_logprobs[pos] - float(lp[prompt[pos]])))
            want = lp.topk(K)
            got = o.prompt_top_logprobs[pos]
            assert list(got) == want.indices.tolist()
            worst = max(worst, max(abs(got[t] - v) for t, v in zip(want.indices.tolist(), want.values.tolist())))
        for j, tok in enumerate(o.token_ids):
            lp = ref[n - 1 + j]
            worst = max(worst, abs(o.logprobs[j] - float(lp[tok])))
            want = lp.topk(K)
            assert list(o.top_logprobs[j]) == want.indices.tolist()
            worst = max(worst, max(abs(o.top_logprobs[j][t] - v) for t, v in zip(want.indices.tolist(),
                                                                                 want.values.tolist())))
        assert worst < TOL, worst
    assert out["b"].prompt_logprobs is None and out["b"].top_logprobs is None


def test_logprobs_zero_and_max_tokens_zero(model: Transformer) -> None:
    eng = LLMEngine(model, max_num_batched_tokens=64)
    prompt = [1, 2, 3, 4, 5, 6]
    out = run(eng, {"z": (prompt, SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=0)),
                    "k0": (prompt, SamplingParams(temperature=0, max_tokens=2, logprobs=0, ignore_eos=True))})
    z = out["z"]
    assert z.token_ids == [] and z.finish_reason == "length" and z.text == ""
    ref = hand_logprobs(model, prompt)
    assert z.prompt_top_logprobs[1:] == [{}] * 5
    assert max(abs(z.prompt_logprobs[p] - float(ref[p - 1, prompt[p]])) for p in range(1, 6)) < TOL
    k0 = out["k0"]
    assert k0.top_logprobs == [{}, {}] and len(k0.logprobs) == 2 and all(math.isfinite(x) for x in k0.logprobs)


def test_logprob_fields_are_validated(model: Transformer) -> None:
    eng = LLMEngine(model)
    from kvshare.errors import RequestError

    for bad, field in [(dict(logprobs=21), "logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs"),
                       (dict(logprobs=1.5), "logprobs")]:
        with pytest.raises(RequestError, match=field):
            eng.add_request("x", [1, 2], SamplingParams(**bad))
