"""Prefix caching under DSpark speculative decoding: only committed tokens enter the cache.

tiny-v41-dspark (float64, quantisation on, as in test_speculative_exact). A chat-like second turn
(turn 1's prompt + reply + new tokens) must hit the cache and decode exactly the greedy tokens of a
plain engine with caching off; rejected drafts never reach a cached block or checkpoint.
"""

from __future__ import annotations

from kvshare.engine.engine import LLMEngine
from kvshare.engine.sampling import SamplingParams
from test_speculative_exact import SPEC, model_and_prompts

N = 14


def _run(eng: LLMEngine, prompt: list[int], rid: str):
    eng.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True))
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
    assert eng.blocks.allocator.num_used == 0
    return out


def test_speculative_turns_hit_and_match_plain_greedy():
    model, prompts, _ = model_and_prompts()
    kw = {"block_size": 8, "num_blocks": 40, "max_num_seqs": 2, "max_num_batched_tokens": 256}
    eng = LLMEngine(model, speculative_config=SPEC, **kw)
    ref = LLMEngine(model, enable_prefix_caching=False, **kw)
    p1 = prompts[3]
    out1 = _run(eng, p1, "t1")
    assert out1.token_ids == _run(ref, p1, "r1").token_ids
    p2 = p1 + out1.token_ids + [5, 6, 7]
    out2 = _run(eng, p2, "t2")
    assert out2.num_cached_tokens == (len(p1) + N - 1) // 8 * 8  # turn 1 finished with 46 computed: 40
    assert out2.token_ids == _run(ref, p2, "r2").token_ids
    assert eng.stats().extra.get("spec_num_verifies", 0) > 0  # drafts were verified (and some rejected)
