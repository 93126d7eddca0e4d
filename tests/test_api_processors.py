"""Logits processors (logit_bias, allowed_token_ids, min_tokens) against element-wise hand code, and
their effect under speculative verification (the same greedy tokens and logprobs as plain decoding)."""

from __future__ import annotations

import math

import torch

from kvshare.engine.logits_processors import apply_processors
from kvshare.engine.sampling import Sampler, SamplingParams
from kvshare.llm import LLM


def hand(row: list[float], p: SamplingParams, out_len: int, eos: set[int]) -> list[float]:
    """One row processed with Python scalars, rule by rule."""
    out = list(row)
    stop = {v for v in range(len(out)) if (v in eos and not p.ignore_eos) or v in p.stop_token_ids}
    allowed = set(p.allowed_token_ids or range(len(out)))
    # min_tokens yields when the allowed ids are all stop tokens (else no id could be sampled)
    hold = out_len < p.min_tokens and not allowed <= stop
    for v in range(len(out)):
        if v not in allowed:
            out[v] = -math.inf
        if hold and v in stop:
            out[v] = -math.inf
        if p.logit_bias and v in p.logit_bias and out[v] != -math.inf:
            out[v] += p.logit_bias[v]
    return out


def test_processors_match_hand_rules() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 40, generator=g)
    params = [SamplingParams(logit_bias={3: 2.5, 7: -1.0, 39: 100.0}),
              SamplingParams(allowed_token_ids=[1, 2, 5], logit_bias={2: -0.5}),
              SamplingParams(min_tokens=3, stop_token_ids=[11]),
              SamplingParams(min_tokens=3, stop_token_ids=[11], ignore_eos=True),
              SamplingParams(),
              SamplingParams(min_tokens=3, stop_token_ids=[11], allowed_token_ids=[9, 11]),
              SamplingParams(min_tokens=3, allowed_token_ids=[9, 12])]
    out_lens = [0, 0, 1, 2, 0, 1, 1]
    eos = {9, 10}
    got = apply_processors(logits, params, out_lens, eos)
    for i, p in enumerate(params):
        want = hand(logits[i].tolist(), p, out_lens[i], eos)
        # the float64 sum of two fp32 values is exact; rounding it to fp32 is what one fp32 add gives
        assert torch.equal(got[i], torch.tensor(want, dtype=torch.float32)), i
    assert apply_processors(logits, [SamplingParams()] * 7, [0] * 7, eos) is logits
    done = apply_processors(logits, [SamplingParams(min_tokens=2)], [2], eos)  # reached: nothing masked
    assert done is logits


def test_sampler_greedy_and_random_rows_honour_processors() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 50, generator=g)
    s = Sampler()
    params = [SamplingParams(temperature=0, allowed_token_ids=[4, 8, 15]),
              SamplingParams(temperature=1.0, allowed_token_ids=[16, 23, 42]),
              SamplingParams(temperature=0, logit_bias={int(logits[2].argmin()): 100.0})]
    toks, lps = s(logits, params, ["a", "b", "c"], [([], []), ([], []), ([], [])])
    assert int(toks[0]) == max((4, 8, 15), key=lambda v: float(logits[0, v]))
    assert int(toks[1]) in (16, 23, 42)
    assert int(toks[2]) == int(logits[2].argmin())
    raw = torch.log_softmax(logits[2], -1)[int(toks[2])]
    assert abs(float(lps[2]) - float(raw)) < 1e-6  # the reported logprob is the raw one


def test_processors_under_speculation_equal_plain() -> None:
    prompts = [[5, 9, 200, 3], [17] * 11]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logit_bias={65: 3.0, 66: 2.0},
                             logprobs=3),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, allowed_token_ids=list(range(60, 80)),
                             logprobs=3)]
    plain = LLM("tiny-v41-dspark").generate(prompts, params, use_tqdm=False)
    want = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
    llm = LLM("tiny-v41-dspark", speculative_config={"method": "dspark", "num_speculative_tokens": 4})
    calls = {"n": 0}

    def oracle(seq, k):  # the plain continuation, with every third proposal wrong (a rejection)
        done = len(seq.output_token_ids)
        drafts = list(want[tuple(seq.prompt_token_ids)][done:done + k])
        calls["n"] += 1
        if calls["n"] % 3 == 0 and drafts:
            drafts[-1] = (drafts[-1] + 1) % 256
        return drafts + [0] * (k - len(drafts))

    llm.engine.speculator.draft_override = oracle
    spec = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(spec, plain):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
        assert [list(t) for t in a.top_logprobs] == [list(t) for t in b.top_logprobs]
    assert llm.engine.stats().extra["spec_accepted_tokens"] > 0


def test_min_tokens_yields_when_only_stop_tokens_are_allowed() -> None:
    """allowed_token_ids = the eos alone with min_tokens: the row is not all -inf (before the fix
    every logit was -inf and greedy emitted id 0, an id the request forbade); a structured mask that
    allows only eos (a complete grammar) likewise lets the request stop."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 30, generator=g)
    eos = {7}
    params = [SamplingParams(temperature=0, min_tokens=4, allowed_token_ids=[7]),
              SamplingParams(temperature=1.0, min_tokens=4, allowed_token_ids=[7]),
              SamplingParams(temperature=0, min_tokens=4)]
    only_eos = torch.zeros(30, dtype=torch.bool)
    only_eos[7] = True
    got = apply_processors(logits, params, [0, 0, 0], eos, masks=[None, None, only_eos])
    for i in range(3):
        assert torch.isfinite(got[i]).nonzero().flatten().tolist() == [7], i
    s = Sampler()
    s.eos_ids = frozenset(eos)
    s.masks_for = lambda ids: [None, None, only_eos]
    toks, _ = s(logits, params, ["a", "b", "c"], [([], []), ([], []), ([], [])])
    assert toks.tolist() == [7, 7, 7]
