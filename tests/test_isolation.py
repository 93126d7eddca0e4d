"""One bad request never hurts the others: admission ranges, per-request failure inside a step.

Failures are injected into one request of a running batch (a model that raises when a poison
token is in its input, a sampler that raises for one request); that request finishes with
finish_reason "error" and the others produce exactly the tokens of an undisturbed run.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvshare import LLM, SamplingParams
from kvshare.config import load_config
from kvshare.engine.engine import LLMEngine
from kvshare.errors import RequestError
from kvshare.model.deepseek import Transformer
from test_engine_api import drain

POISON = 251  # a token id no clean prompt below contains
PROMPTS = [[5 + i, 17, 99, 3, 40 + i, 41, 7][: 3 + i % 5] for i in range(8)]


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer(load_config("tiny-v41"), quant=False).init_weights(3).eval()


class PoisonedModel(torch.nn.Module):
    """Wraps a model; its forward raises whenever the poison token is among the input ids."""

    def __init__(self, inner: Transformer) -> None:
        super().__init__()
        self.inner = inner
        self.cfg = inner.cfg
        self.topo = getattr(inner, "topo", None)
        self.calls = 0

    def bind(self, choice: Any) -> None:
        """The engine binds its model's kernels once (`Transformer.bind`): the wrapped model's."""
        self.inner.bind(choice)

    def forward(self, input_ids: torch.Tensor, batch: Any, backend: Any) -> torch.Tensor:
        self.calls += 1
        if bool((input_ids == POISON).any()):
            raise RuntimeError("injected failure: poison token in the batch")
        return self.inner(input_ids, batch, backend)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n)


@pytest.mark.parametrize("field, params", [
    ("top_k", SamplingParams(temperature=0, top_k=2**63)),
    ("top_k", SamplingParams(top_k=2**40)),
    ("seed", SamplingParams(temperature=1.0, seed=2**64)),
    ("seed", SamplingParams(temperature=1.0, seed=-(2**63) - 1)),
    ("stop_token_ids", SamplingParams(stop_token_ids=[True])),  # type: ignore[list-item]
    ("temperature", SamplingParams(temperature=float("inf"))),
])
def test_out_of_range_params_are_refused_at_admission(model, field, params) -> None:
    eng = LLMEngine(model, max_model_len=32, num_blocks=20, block_size=8, max_num_seqs=4)
    with pytest.raises(RequestError, match=field):
        eng.add_request("bad", PROMPTS[0], params)
    eng.add_request("ok", PROMPTS[0], greedy(3))
    assert drain(eng)["ok"].finish_reason == "length"


def test_extreme_but_valid_params_run(model) -> None:
    """The edges of the accepted ranges reach the sampler and work there."""
    eng = LLMEngine(model, max_model_len=32, num_blocks=20, block_size=8, max_num_seqs=4)
    eng.add_request("k", PROMPTS[0], SamplingParams(temperature=1.0, top_k=2**31 - 1, max_tokens=2))
    eng.add_request("s1", PROMPTS[1], SamplingParams(temperature=1.0, seed=2**64 - 1, max_tokens=2))
    eng.add_request("s2", PROMPTS[2], SamplingParams(temperature=1.0, seed=-(2**63), max_tokens=2))
    out = drain(eng)
    assert {o.finish_reason for o in out.values()} == {"length"}


def test_poisoned_forward_fails_only_its_request(model) -> None:
    ref = drain_all(LLMEngine(model, max_model_len=48, num_blocks=40, block_size=8, max_num_seqs=8), PROMPTS, 6)
    poisoned = PoisonedModel(model)
    eng = LLMEngine(poisoned, max_model_len=48, num_blocks=40, block_size=8, max_num_seqs=12)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, greedy(6))
    eng.step()  # the batch runs once clean ...
    eng.add_request("bad", [9, 9, POISON, 9], greedy(6))  # ... then a poisoned request joins it
    calls = poisoned.calls
    outs = eng.step()  # the batch with the poisoned request fails and is requeued: nothing to report
    assert poisoned.calls == calls + 1 and outs == [] and len(eng._suspects) == len(PROMPTS) + 1
    out = drain(eng)
    assert out["bad"].finish_reason == "error" and "poison" in out["bad"].error
    for i in range(len(PROMPTS)):
        assert out[f"r{i}"].token_ids == ref[f"r{i}"], i
        assert out[f"r{i}"].finish_reason == "length"
    assert eng.blocks.allocator.num_used == 0
    # the engine is not poisoned: later requests run normally
    eng.add_request("after", PROMPTS[3], greedy(6))
    assert drain(eng)["after"].token_ids == ref["r3"]


def drain_all(eng: LLMEngine, prompts: list[list[int]], n: int) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, greedy(n))
    return {k: o.token_ids for k, o in drain(eng).items()}


def test_failing_sampler_row_fails_only_its_request(model, monkeypatch) -> None:
    ref = drain_all(LLMEngine(model, max_model_len=48, num_blocks=40, block_size=8, max_num_seqs=8), PROMPTS, 5)
    eng = LLMEngine(model, max_model_len=48, num_blocks=40, block_size=8, max_num_seqs=8)
    real = eng.sampler.generator_for

    def generator_for(request_id: str, seed: int) -> torch.Generator:
        if request_id == "bad":
            raise RuntimeError("injected sampler failure")
        return real(request_id, seed)

    monkeypatch.setattr(eng.sampler, "generator_for", generator_for)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, greedy(5))
    eng.add_request("bad", PROMPTS[0], SamplingParams(temperature=1.0, seed=7, max_tokens=5))
    out = drain(eng)
    assert out["bad"].finish_reason == "error" and "injected sampler failure" in out["bad"].error
    assert {k: out[k].token_ids for k in ref} == ref
    assert eng.blocks.allocator.num_used == 0


def test_llm_instance_survives_a_bad_request(model) -> None:
    """The reproduction from the issue: top_k >= 2**63 used to break every later call."""
    llm = LLM(model, max_model_len=32, num_blocks=20, block_size=8, max_num_seqs=4)
    outs = llm.generate([PROMPTS[0], PROMPTS[1]], [greedy(3), SamplingParams(temperature=0, top_k=2**63)],
                        use_tqdm=False)
    assert outs[0].finish_reason == "length" and outs[1].finish_reason == "error"
    assert "top_k" in outs[1].error
    again = llm.generate([PROMPTS[0]], greedy(3), use_tqdm=False)
    assert again[0].token_ids == outs[0].token_ids
