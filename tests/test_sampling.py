"""SamplingParams validation and the batched Sampler."""

import pytest
import torch

from kvshare.engine.sampling import Sampler, SamplingParams
from kvshare.errors import RequestError


@pytest.mark.parametrize("kw", [
    dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_p=0.0), dict(top_p=1.5),
    dict(top_k=-2), dict(max_tokens=-1), dict(max_tokens=1.5), dict(stop=[""]), dict(stop_token_ids=[300]),
    dict(seed="x"),
])
def test_invalid_params_raise_request_error(kw):
    with pytest.raises(RequestError):
        SamplingParams(**kw).validate(vocab_size=256)


def test_valid_params_and_stop_string_normalised():
    p = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, stop="END", seed=3)
    p.validate(256)
    assert p.stop == ["END"]


def test_greedy_and_logprob():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 2.0, -1.0]])
    toks, lp = Sampler()(logits, [SamplingParams(temperature=0, logprobs=0)] * 2, ["a", "b"])
    assert toks.tolist() == [1, 0]  # tie -> lowest id
    assert torch.allclose(lp, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])
    # a greedy batch that asks for no logprobs skips them (NaN, never reported); one asking row computes all
    toks, lp = Sampler()(logits, [SamplingParams(temperature=0)] * 2, ["a", "b"])
    assert toks.tolist() == [1, 0] and lp.isnan().all()
    _, lp = Sampler()(logits, [SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=0)], ["a", "b"])
    assert torch.allclose(lp, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


def test_top_k_one_and_tiny_top_p_are_greedy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 50, generator=g)
    s = Sampler(seed=1)
    params = [SamplingParams(temperature=1.0, top_k=1)] * 8 + [SamplingParams(temperature=1.0, top_p=1e-6)] * 8
    toks, _ = s(logits, params, [str(i) for i in range(16)])
    assert toks.tolist() == logits.argmax(-1).tolist()


def test_top_k_restricts_support_and_distribution_matches():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]]).repeat(4000, 1)
    s = Sampler(seed=0)
    toks, _ = s(logits, [SamplingParams(temperature=1.0, top_k=2)] * 4000, [str(i) for i in range(4000)])
    assert set(toks.tolist()) <= {0, 1}
    freq0 = (toks == 0).float().mean().item()
    expect = torch.softmax(torch.tensor([2.0, 1.0]), 0)[0].item()
    assert abs(freq0 - expect) < 0.04


def test_top_p_keeps_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(3000, 1)
    toks, _ = Sampler(seed=0)(logits, [SamplingParams(top_p=0.7)] * 3000, [str(i) for i in range(3000)])
    assert set(toks.tolist()) == {0, 1}


def test_top_p_drops_the_token_whose_preceding_mass_equals_p_exactly():
    """Four equal logits (probabilities 1/4, exact in fp32), top_p 0.5: the smallest prefix whose
    mass reaches 0.5 is {0, 1} (0.25 + 0.25 = 0.5), so token 2, preceded by exactly 0.5, is out
    (the boundary is ``mass before >= top_p``); both kept tokens occur."""
    logits = torch.zeros(2000, 4)
    toks, _ = Sampler(seed=0)(logits, [SamplingParams(top_p=0.5)] * 2000, [str(i) for i in range(2000)])
    assert set(toks.tolist()) == {0, 1}


def test_seeded_requests_do_not_depend_on_the_batch():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.0, seed=42)
    alone = [Sampler(seed=9)(logits[1:2], [p], ["x"])[0].item() for _ in range(1)]
    s = Sampler(seed=123)
    mixed, _ = s(logits, [SamplingParams(temperature=1.0), p, SamplingParams(temperature=0)], ["u", "x", "v"])
    assert mixed[1].item() == alone[0]
    assert mixed[2].item() == logits[2].argmax().item()
    # a seeded stream continues deterministically across steps
    s1, s2 = Sampler(seed=0), Sampler(seed=5)
    a = [s1(logits[1:2], [p], ["x"])[0].item() for _ in range(5)]
    b = [s2(logits[1:2], [p], ["x"])[0].item() for _ in range(5)]
    assert a == b
