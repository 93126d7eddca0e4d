"""The offline API in vLLM's shape (issue 35): `outputs[i]`, `SamplingParams(n=...)`, prompt dicts,
`LLM.chat`, and an `LLM` whose tensor-parallel group ends with it, so a second one can start in
the same process (closed, or dropped without closing) and gives the same greedy tokens."""

from __future__ import annotations

import gc
import math
import multiprocessing as mp
import os

import pytest

from kvshare.engine.sampling import SamplingParams
from kvshare.llm import LLM, CompletionOutput, Logprob
from kvshare.tokenizer import ByteTokenizer

KW = dict(quantize=False, dtype="float32", max_model_len=256)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-v41", tokenizer=ByteTokenizer(256), **KW)


def test_outputs_are_vllm_shaped_and_n_samples_seed_plus_i(llm: LLM) -> None:
    p = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, logprobs=2)
    [out] = llm.generate("Hello", p, use_tqdm=False)
    assert len(out.outputs) == 3 and all(isinstance(c, CompletionOutput) for c in out.outputs)
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.prompt_token_ids == list(b"Hello")
    for i, c in enumerate(out.outputs):  # sequence i is the request with seed 7 + i, run alone
        [alone] = llm.generate("Hello", SamplingParams(temperature=1.0, seed=7 + i, max_tokens=6, logprobs=2),
                               use_tqdm=False)
        assert c.token_ids == alone.token_ids and c.text == alone.text and c.finish_reason == "length"
        # the chosen token's entry is its top-k value when it has one: the engine computes the two apart and
        # they may differ by an fp32 ulp (observed 2.4e-7); the tolerance is a few ulps
        got = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]
        assert all(math.isclose(x, y, abs_tol=1e-6) for x, y in zip(got, alone.logprobs, strict=True))
        assert all(isinstance(v, Logprob) for lp in c.logprobs for v in lp.values())
        assert math.isclose(c.cumulative_logprob, sum(got), rel_tol=1e-12)
        top1 = [min(lp.values(), key=lambda v: v.rank or 99) for lp in c.logprobs]
        assert all(v.rank == 1 and v.decoded_token is not None for v in top1)
    assert (out.text, out.token_ids) == (out.outputs[0].text, out.outputs[0].token_ids)  # the earlier API


def test_prompt_dicts_and_chat(llm: LLM) -> None:
    g = SamplingParams(temperature=0, max_tokens=5)
    a, b, c = llm.generate(["Hi", {"prompt_token_ids": list(b"Hi")}, {"prompt": "Hi"}], g, use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    [bad] = llm.generate([{"tokens": [1]}], g, use_tqdm=False)
    assert bad.finish_reason == "error" and "prompt_token_ids" in bad.error
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    [chat] = llm.chat(msgs, g, use_tqdm=False)
    ids = llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    [direct] = llm.generate({"prompt_token_ids": ids}, g, use_tqdm=False)
    assert chat.prompt_token_ids == ids and chat.outputs[0].token_ids == direct.outputs[0].token_ids
    assert len(llm.chat([msgs, msgs[1:]], g, use_tqdm=False)) == 2
    with pytest.raises(Exception):
        SamplingParams(n=0).validate()


def test_context_manager_closes() -> None:
    with LLM("tiny-v41", tokenizer=ByteTokenizer(256), **KW) as one:
        assert not one.closed
    assert one.closed
    with pytest.raises(RuntimeError, match="shut down"):
        one.generate("x", use_tqdm=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes only once reaped
        return f.read().split()[2] != "Z"


def _tp_tokens() -> tuple[list[int], list[int], LLM]:
    llm = LLM("tiny-v41", tensor_parallel_size=2, **KW)
    [out] = llm.generate([list(b"The quick brown fox")], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    pids = [p.pid for p in llm.engine.tp.procs]
    return out.outputs[0].token_ids, pids, llm


def test_tp_llm_closed_dropped_and_recreated_in_one_process() -> None:
    """Mutation caught: the finalizer that `shutdown` and garbage collection run not stopping the engine
    (the workers stay alive; a second group would then fail to initialise)."""
    first, pids1, llm = _tp_tokens()
    llm.shutdown()
    assert llm.closed and not any(_alive(p) for p in pids1)
    second, pids2, llm2 = _tp_tokens()  # re-created after an explicit close
    assert second == first
    del llm2  # dropped without closing: the garbage collector's finalizer ends the group
    gc.collect()
    assert not any(_alive(p) for p in pids2)
    third, pids3, llm3 = _tp_tokens()
    assert third == first
    with llm3:
        pass
    assert not any(_alive(p) for p in pids3) and not mp.active_children()
