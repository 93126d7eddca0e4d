"""Penalties, min_p and the sampler's fast paths, checked against formulas written out here.

Semantics (OpenAI / vLLM): repetition_penalty r over prompt + output tokens divides a positive
logit by r and multiplies a negative one by r; frequency (per occurrence) and presence (once)
penalties are subtracted for tokens of the OUTPUT only. min_p keeps tokens whose probability
(after temperature) is at least min_p times the row's largest.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvshare.engine.engine import LLMEngine
from kvshare.engine.penalties import apply_penalties
from kvshare.engine.sampling import Sampler, SamplingParams
from kvshare.errors import RequestError


def hand_penalised(row: list[float], prompt: list[int], output: list[int], r: float, f: float, p: float) -> list[float]:
    """The penalty formulas, one token at a time."""
    seen = set(prompt) | set(output)
    out = []
    for v, x in enumerate(row):
        if v in seen:
            x = x / r if x > 0 else x * r
        c = output.count(v)
        x = x - f * c - (p if c > 0 else 0.0)
        out.append(x)
    return out


CASES = [  # (prompt, output, repetition, frequency, presence)
    ([0, 1, 2], [3, 3, 4, 1], 1.3, 0.5, 0.25),
    ([5, 5, 6], [], 2.0, 1.0, 1.0),  # nothing generated yet: only the repetition penalty acts
    ([7], [7, 7, 7, 8], 1.0, -0.5, 2.0),  # negative frequency penalty rewards repeats
    ([9, 2], [11, 2], 0.5, 0.0, -1.0),  # r < 1 favours seen tokens
]


def test_penalties_match_the_formulas():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(CASES), 12, generator=g) * 3  # both signs occur in every row
    hist = [(c[0], c[1]) for c in CASES]
    rep, freq, pres = (torch.tensor([c[k] for c in CASES]) for k in (2, 3, 4))
    got = apply_penalties(logits, hist, rep, freq, pres)
    want = torch.tensor([hand_penalised(logits[i].tolist(), *CASES[i]) for i in range(len(CASES))])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # observed max error 4.8e-7 (fp32 rounding)


def test_prompt_tokens_get_only_the_repetition_penalty():
    logits = torch.tensor([[2.0, -2.0, 2.0, 1.0]])
    hist = [([0, 1], [2, 2])]
    got = apply_penalties(logits, hist, torch.tensor([2.0]), torch.tensor([0.5]), torch.tensor([0.25]))
    # 0, 1 in the prompt: 2/2, -2*2; 2 twice in the output: 2/2 - 2*0.5 - 0.25; 3 unseen
    assert got.tolist() == [[1.0, -4.0, -0.25, 1.0]]


def test_sampler_applies_penalties_before_greedy_and_reports_raw_logprob():
    logits = torch.tensor([[3.0, 2.9, 0.0], [3.0, 2.9, 0.0], [1.0, 0.5, 0.2]])
    params = [SamplingParams(temperature=0, presence_penalty=0.2), SamplingParams(temperature=0),
              SamplingParams(temperature=0, repetition_penalty=3.0)]
    hist = [([1], [0]), ([1], [0]), ([0], [])]
    toks, lp = Sampler()(logits, params, ["a", "b", "c"], hist)
    assert toks.tolist() == [1, 0, 1]  # 3-0.2 < 2.9; untouched row; 1/3 < 0.5
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1)[[0, 1, 2], [1, 0, 1]])


def test_penalties_without_history_raise():
    with pytest.raises(ValueError, match="history"):
        Sampler()(torch.zeros(1, 4), [SamplingParams(frequency_penalty=1.0)], ["a"])


@pytest.mark.parametrize("kw,field", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"), (dict(repetition_penalty=True), "repetition_penalty"),
    (dict(min_p=1.5), "min_p"), (dict(min_p=-0.1), "min_p"), (dict(min_p="0.1"), "min_p"),
])
def test_bad_penalty_values_name_the_field(kw, field):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**kw).validate(256)


def test_min_p_support_and_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 6000
    logits = probs.log().repeat(n, 1)
    toks, _ = Sampler(seed=0)(logits, [SamplingParams(min_p=0.25)] * n, [str(i) for i in range(n)])
    assert set(toks.tolist()) == {0, 1, 2}  # 0.05 < 0.25 * 0.5 dropped, 0.15 kept
    freq = torch.bincount(toks, minlength=4).float() / n
    want = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    assert (freq - want).abs().max() < 0.025  # ~4 sigma of a binomial at n=6000; observed 0.0067


def test_min_p_applies_after_temperature():
    logits = torch.tensor([[0.0, math.log(0.3)]]).repeat(2000, 1)  # p = (0.77, 0.23) at T=1
    t2 = Sampler(seed=1)(logits, [SamplingParams(temperature=2.0, min_p=0.5)] * 2000, [str(i) for i in range(2000)])
    t1 = Sampler(seed=1)(logits, [SamplingParams(temperature=1.0, min_p=0.5)] * 2000, [str(i) for i in range(2000)])
    assert set(t1[0].tolist()) == {0}  # 0.3 < 0.5
    assert set(t2[0].tolist()) == {0, 1}  # at T=2 the ratio is sqrt(0.3) = 0.55 >= 0.5


def test_plain_temperature_sampling_needs_no_sort_and_matches_softmax(monkeypatch):
    def no_sort(*a, **k):
        raise AssertionError("sorted the vocabulary")

    monkeypatch.setattr(torch.Tensor, "sort", no_sort)
    monkeypatch.setattr(torch, "sort", no_sort)
    base = torch.tensor([1.0, 0.0, -1.0, 0.5])
    n = 6000
    params = [SamplingParams(temperature=0.7)] * n + [SamplingParams(temperature=0)] * 2
    toks, _ = Sampler(seed=3)(base.repeat(n + 2, 1), params, [str(i) for i in range(n + 2)])
    assert toks[n:].tolist() == [0, 0]
    freq = torch.bincount(toks[:n], minlength=4).float() / n
    assert (freq - torch.softmax(base / 0.7, 0)).abs().max() < 0.025  # ~4 sigma at n=6000; observed 0.0067


def test_greedy_batch_does_no_softmax(monkeypatch):
    def no_softmax(*a, **k):
        raise AssertionError("softmax on a greedy batch")

    monkeypatch.setattr(torch, "softmax", no_softmax)
    monkeypatch.setattr(torch.Tensor, "softmax", no_softmax)
    monkeypatch.setattr(torch.Tensor, "sort", no_softmax)
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(2))
    toks, _ = Sampler()(logits, [SamplingParams(temperature=0)] * 5, list("abcde"))
    assert toks.tolist() == logits.argmax(-1).tolist()


@pytest.fixture(scope="module")
def tiny_model():
    from kvshare.config import load_config
    from kvshare.model.deepseek import Transformer

    return Transformer(load_config("tiny-v41"), quant=False).init_weights(5).double().eval()


def test_engine_penalised_greedy_matches_dense_recomputation(tiny_model):
    """Engine greedy with all three penalties == argmax of the hand formulas on the dense path's logits."""
    from kvshare.train.loop import forward_contexts

    prompt = [5, 17, 99, 3, 160, 238, 125, 253, 160]  # holds tokens the model likes to emit
    kw = dict(repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.4)
    eng = LLMEngine(tiny_model, max_model_len=64, num_blocks=24, block_size=8, max_num_seqs=2, dtype=torch.float64)
    eng.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=12, **kw))
    got = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                got = o.token_ids
    out: list[int] = []
    with torch.no_grad():
        for _ in range(12):
            logits, _ = forward_contexts(tiny_model, [torch.tensor(prompt + out + [0])])
            row = hand_penalised(logits[-1].tolist(), prompt, out, 1.5, 0.7, 0.4)
            out.append(max(range(len(row)), key=lambda v: (row[v], -v)))
    plain = []
    with torch.no_grad():
        for _ in range(12):
            logits, _ = forward_contexts(tiny_model, [torch.tensor(prompt + plain + [0])])
            plain.append(int(logits[-1].argmax()))
    assert got == out
    assert out != plain  # the penalties changed the output, so the comparison is not vacuous


def test_speculation_verifies_with_penalties_and_min_p():
    """With speculation on, requests using penalties or min_p speculate too: each verified row j is
    penalised with the history (prompt, output + d_1..d_j). A drafter proposing the plain engine's
    own (penalised) continuation is accepted in full, and every output equals the plain engine's."""
    from test_speculative_exact import SPEC, model_and_prompts

    model, prompts, refs = model_and_prompts()
    prompt = prompts[2] + refs[2][:8]  # holds tokens the model likes to emit, so the penalties bite
    params = {"pen": SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=3.0,
                                    frequency_penalty=2.0, presence_penalty=1.0),
              "minp": SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, min_p=0.2),
              "greedy": SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)}
    drafted_for: set[str] = set()

    def outputs(spec, plain=None):
        eng = LLMEngine(model, speculative_config=spec, dtype=torch.float64)
        if spec is not None:
            def oracle(seq, k):  # the test hook that replaces the DSpark proposal
                drafted_for.add(seq.request_id)
                ahead = plain[seq.request_id][len(seq.output_token_ids):]
                return (ahead + [0] * k)[:k]
            eng.speculator.draft_override = oracle
        for name, p in params.items():
            eng.add_request(name, prompt, p)
        done = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.token_ids
        return done, eng

    plain, _ = outputs(None)
    spec, eng = outputs(SPEC, plain)
    assert spec == plain
    assert plain["pen"] != plain["greedy"]  # the penalties changed the output
    assert drafted_for == set(params)
    st = eng.stats().extra
    assert st["spec_accepted_tokens"] == st["spec_draft_tokens"]  # penalised rows accepted the penalised chain


def test_penalised_rows_follow_the_drafts():
    """Row j of a verified chunk is penalised with output + drafts[:j] (hand formula per row)."""
    from types import SimpleNamespace

    from kvshare.engine.spec_accept import penalised_rows

    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    pen = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    seqs = [SimpleNamespace(params=pen, prompt_token_ids=[1], output_token_ids=[2, 2]),
            SimpleNamespace(params=SamplingParams(), prompt_token_ids=[1], output_token_ids=[2])]
    got = penalised_rows(logits, [[3, 2], [4, 4]], seqs)
    for j, out in enumerate([[2, 2], [2, 2, 3], [2, 2, 3, 2]]):
        want = hand_penalised(logits[0, j].tolist(), [1], out, 2.0, 0.5, 0.25)
        assert torch.allclose(got[0, j], torch.tensor(want, dtype=torch.float64), atol=1e-12)  # observed 0
    assert torch.equal(got[1], logits[1])
