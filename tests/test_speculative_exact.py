"""DSpark speculative decoding in the engine never changes greedy output, and rolls back exactly.

tiny-v41-dspark in float64 with quantisation on (packed window / compressed rows store the
fake-quantised rows exactly; batch-shape noise ~1e-16 never reaches an FP8/FP4 rounding
boundary). Requests of mixed prompt lengths run together with a small token budget (chunked
prefill mixed with verify steps) and a pool too small for all (preemption during speculation).
The plain greedy reference is the dense path (Transformer + DenseCache), one request at a time.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvshare.config import load_config
from kvshare.engine.engine import LLMEngine
from kvshare.engine.sampling import SamplingParams
from kvshare.model.deepseek import Transformer
from kvshare.model.dense_cache import DenseCache
from kvshare.model.dspark import attach_dspark
from kvshare.runtime import StepBatch

PROMPT_LENS = [1, 7, 19, 33, 12]
MAX_TOKENS = 14
SPEC = {"method": "dspark", "num_speculative_tokens": 5}
# Float64 end to end: observed max |engine - fresh prefill| is 0 to ~4e-15 on these runs.
LOGIT_TOL = 1e-9
_CACHE: dict = {}


def model_and_prompts(name: str = "tiny-v41-dspark"):
    """(model, prompts, plain greedy continuations) of a DSpark config, built once per session.
    tiny-v41-engram-dspark adds Engram at layers 1 and 4 (4 is also a DSpark target)."""
    if name not in _CACHE:
        cfg = load_config(name)
        m = Transformer(cfg, quant=True)
        attach_dspark(m)
        m = m.init_weights(1).double().eval()
        rng = random.Random(13)
        prompts = [[rng.randrange(cfg.vocab_size - 1) for _ in range(n)] for n in PROMPT_LENS]
        _CACHE[name] = (m, prompts, [greedy_reference(m, p, MAX_TOKENS + 6) for p in prompts])
    return _CACHE[name]


@torch.inference_mode()
def prefill_logits(model: Transformer, toks: list[int]) -> torch.Tensor:
    """Next-token logits after a fresh one-shot prefill of `toks` (dense path)."""
    cache = DenseCache(model.cfg, model.topo, 1, len(toks) + 1, dtype=torch.float64)
    batch = StepBatch.build([0], [len(toks)], [0], logit_rows=[len(toks) - 1])
    return model(torch.tensor(toks), batch, cache)[0]


@torch.inference_mode()
def greedy_reference(model: Transformer, prompt: list[int], n: int) -> list[int]:
    cache = DenseCache(model.cfg, model.topo, 1, len(prompt) + n + 1, dtype=torch.float64)
    toks, out = list(prompt), []
    logits = model(torch.tensor(toks), StepBatch.build([0], [len(toks)], [0], logit_rows=[len(toks) - 1]), cache)
    while len(out) < n:
        out.append(int(logits[-1].argmax()))
        toks.append(out[-1])
        back = toks[max(0, len(toks) - 1 - model.engram_lookback):-1]  # Engram's look-back ids
        batch = StepBatch.build([len(toks) - 1], [1], [0], prev_tokens=[back])
        logits = model(torch.tensor([out[-1]]), batch, cache)
    return out


def run(model, prompts, *, spec=SPEC, override=None, on_step=None, **kw):
    eng = LLMEngine(model, speculative_config=spec, **kw)
    if override is not None:
        eng.speculator.draft_override = override
    seqs = {}
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        seqs[str(i)] = eng.requests[str(i)]
    done, steps = {}, 0
    while eng.has_unfinished_requests():
        outs = eng.step()
        if on_step is not None:
            on_step(eng, seqs, outs)
        for o in outs:
            if o.finished:
                done[o.request_id] = o.token_ids
        steps += 1
        assert steps < 1000
    assert eng.blocks.allocator.num_used == 0 and eng.blocks.slots.num_free == eng.blocks.slots.num_slots
    return done, eng


def oracle(refs, prompts, agree: int, vocab: int):
    """Drafter hook: the target's own greedy continuation for `agree` tokens, then wrong tokens."""
    by_prompt = {tuple(p): r for p, r in zip(prompts, refs)}

    def draft(seq, k):
        ref = by_prompt[tuple(seq.prompt_token_ids)]
        n = len(seq.output_token_ids)  # the anchor is output n-1; the next token is ref[n]
        good = ref[n:n + agree]
        bad = [(t + 1) % (vocab - 1) for t in ref[n + agree:n + k]]
        return (good + bad)[:k]
    return draft


@pytest.mark.parametrize("name", ["tiny-v41-dspark", "tiny-v41-engram-dspark"])
@pytest.mark.parametrize("agree", [None, 0, 2, 5])
@pytest.mark.parametrize("budget,num_blocks", [(7, 8), (64, 40)])
def test_speculative_greedy_equals_plain_greedy(agree, budget, num_blocks, name):
    """Token for token, with the DSpark drafter (None) or an oracle agreeing for `agree` tokens;
    budget 7 + 7 usable blocks of 8 forces chunked prefill and preemption during speculation."""
    model, prompts, refs = model_and_prompts(name)
    override = None if agree is None else oracle(refs, prompts, agree, model.cfg.vocab_size)
    done, eng = run(model, prompts, override=override, block_size=8, num_blocks=num_blocks,
                    max_num_seqs=4, max_num_batched_tokens=budget)
    for i, r in enumerate(refs):
        assert done[str(i)] == r[:MAX_TOKENS], f"request {i}"
    st = eng.stats()
    assert st.extra["spec_num_verifies"] > 0
    if num_blocks == 8:
        assert st.num_preemptions > 0, "the pool was meant to be too small"
    if agree == 5:
        assert st.extra["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("name", ["tiny-v41-dspark", "tiny-v41-engram-dspark"])
def test_next_token_logits_equal_fresh_prefill_after_every_step(name):
    """After each step, the row behind every new anchor equals a fresh prefill of the committed
    tokens (rejected rows left no trace in rings, compressor states, the Engram look-back, draft
    windows or blocks)."""
    model, prompts, refs = model_and_prompts(name)
    worst = [0.0]

    def check(eng, seqs, outs):
        for rid, row in eng.speculator.record_logits.items():
            seq = seqs[rid]
            ref = prefill_logits(model, seq.tokens[:seq.num_computed])
            worst[0] = max(worst[0], (row.double() - ref).abs().max().item())
        eng.speculator.record_logits.clear()

    def hook(eng, seqs, outs):
        if eng.speculator.record_logits is None:
            eng.speculator.record_logits = {}
        check(eng, seqs, outs)

    # Oracle agreeing for 3: every step rejects drafts 4-5 and keeps 1-3 (partial acceptance).
    done, eng = run(model, prompts, override=oracle(refs, prompts, 3, model.cfg.vocab_size), on_step=hook,
                    block_size=8, num_blocks=10, max_num_seqs=4, max_num_batched_tokens=9)
    assert eng.stats().num_preemptions > 0
    assert worst[0] < LOGIT_TOL, worst[0]


@pytest.mark.parametrize("agree", range(6))
def test_forced_agreement_commits_exactly_k_plus_one(agree):
    """A drafter right for exactly `agree` tokens commits agree + 1 tokens per verify (K = 5)."""
    model, prompts, refs = model_and_prompts()
    draft = oracle(refs, prompts, agree, model.cfg.vocab_size)
    asked: dict[str, int] = {}

    def override(seq, k):
        asked[seq.request_id] = k
        return draft(seq, k)

    def on_step(eng, seqs, outs):
        for o in outs:
            if o.request_id in asked:
                assert len(o.new_token_ids) == min(agree, asked.pop(o.request_id)) + 1
        assert not asked

    done, eng = run(model, prompts[:3], override=override, on_step=on_step, block_size=8, num_blocks=40,
                    max_num_seqs=4, max_num_batched_tokens=64)
    counts = eng.speculator.acceptance_counts
    assert counts[agree] > 0 and sum(counts) == counts[agree] + sum(counts[:agree])  # never more than agree
    for i in range(3):
        assert done[str(i)] == refs[i][:MAX_TOKENS]


def test_requests_with_and_without_speculation_share_a_step():
    """A prefill chunk, a request with 1 token left (no drafts) and verifying requests in one step."""
    model, prompts, refs = model_and_prompts()
    eng = LLMEngine(model, speculative_config=SPEC, block_size=8, num_blocks=40, max_num_batched_tokens=64)
    eng.scheduler.prefill_tokens_with_decodes = 64  # c's whole prompt beside the decodes (default: 16 a step)
    eng.speculator.draft_override = oracle(refs, prompts, 5, model.cfg.vocab_size)
    eng.add_request("a", prompts[1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    eng.add_request("b", prompts[2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    eng.step()  # both prefilled; each has its first token
    eng.add_request("c", prompts[3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    outs = {o.request_id: o for o in eng.step()}
    assert len(outs["a"].new_token_ids) == 6  # 5 accepted drafts + bonus
    assert len(outs["b"].new_token_ids) == 1 and outs["b"].finished  # plain decode
    assert outs["c"].token_ids == refs[3][:1]  # prefill in the same step
    assert outs["a"].token_ids == refs[1][:7] and outs["b"].token_ids == refs[2][:2]


def test_checkpoint_without_mtp_refuses_speculation(tmp_path):
    from kvshare.errors import CheckpointError, ConfigError
    from kvshare.model.checkpoint_write import save_checkpoint

    cfg = load_config("tiny-v41-dspark")
    save_checkpoint(Transformer(cfg, quant=False).init_weights(0), cfg, tmp_path)
    with pytest.raises(CheckpointError, match="no mtp"):
        LLMEngine(str(tmp_path), speculative_config=SPEC)
    with pytest.raises(ConfigError, match="no DSpark draft stages"):
        LLMEngine("tiny-v41", speculative_config=SPEC)
    with pytest.raises(ConfigError, match="speculative_config.method"):
        LLMEngine("tiny-v41-dspark", speculative_config={"method": "eagle"})
    with pytest.raises(ConfigError, match="exceeds the model's dspark_block_size"):
        LLMEngine("tiny-v41-dspark", speculative_config={"method": "dspark", "num_speculative_tokens": 6})


def test_on_commit_hooks_see_exactly_the_committed_tokens():
    """Per-request state of other features advances by what `num_computed` advances, never by drafts."""
    model, prompts, refs = model_and_prompts()
    seen: dict[str, int] = {}

    def hook(seqs, committed):
        for s, n in zip(seqs, committed):
            seen[s.request_id] = seen.get(s.request_id, 0) + n
            assert seen[s.request_id] == s.num_computed

    eng = LLMEngine(model, speculative_config=SPEC, block_size=8, num_blocks=40, max_num_batched_tokens=16)
    eng.speculator.on_commit.append(hook)
    eng.speculator.draft_override = oracle(refs, prompts, 3, model.cfg.vocab_size)
    for i, p in enumerate(prompts[:3]):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    assert all(seen[str(i)] == len(prompts[i]) + MAX_TOKENS - 1 for i in range(3))


class _Poisoned(torch.nn.Module):
    """The engine's target forward raises whenever `poison` is among the step's input ids."""

    def __init__(self, inner: Transformer, poison: int) -> None:
        super().__init__()
        self.inner, self.poison, self.cfg, self.topo = inner, poison, inner.cfg, inner.topo

    def forward(self, input_ids, batch, backend, state=None):
        if bool((input_ids == self.poison).any()):
            raise RuntimeError("injected failure: poison token")
        return self.inner(input_ids, batch, backend, state)


def test_a_failing_request_fails_alone_during_speculation():
    """A poisoned request joins verifying requests: it finishes with "error"; the others keep the
    plain greedy tokens (their rejected drafts and requeue leave no trace)."""
    model, prompts, refs = model_and_prompts()
    poison = model.cfg.vocab_size - 1
    eng = LLMEngine(model, speculative_config=SPEC, block_size=8, num_blocks=40, max_num_batched_tokens=64)
    eng.speculator.draft_override = oracle(refs, prompts, 2, model.cfg.vocab_size)
    for i, p in enumerate(prompts[:3]):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    eng.step()
    eng.model = _Poisoned(model, poison)
    eng.add_request("bad", [3, poison, 4], SamplingParams(temperature=0, max_tokens=4))
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert done["bad"].finish_reason == "error" and "poison" in done["bad"].error
    for i in range(3):
        assert done[str(i)].token_ids == refs[i][:MAX_TOKENS]
    assert eng.blocks.allocator.num_used == 0


def test_rejected_drafts_leave_no_blocks_behind():
    """After every step each running request holds exactly the blocks of its committed tokens
    (ceil(num_computed / B)): the blocks allocated for rejected drafts went back to the pool, and
    the pool's used count is the sum over requests. Oracle agreeing for 1 of 5 drafts, B = 4, so
    every verify allocates a block past the committed tokens."""
    model, prompts, refs = model_and_prompts()
    checked = [0]

    def check(eng, seqs, outs):
        held = 0
        for seq in eng.scheduler.running:
            ids = eng.blocks.block_ids[seq.slot]
            assert len(ids) == -(-seq.num_computed // 4), (seq.request_id, len(ids), seq.num_computed)
            held += len(ids)
            checked[0] += 1
        assert eng.blocks.allocator.num_used == held

    done, eng = run(model, prompts, override=oracle(refs, prompts, 1, model.cfg.vocab_size), on_step=check,
                    block_size=4, num_blocks=80, max_num_seqs=5, max_num_batched_tokens=64)
    assert checked[0] > 20 and eng.stats().extra["spec_accepted_tokens"] > 0
    for i, r in enumerate(refs):
        assert done[str(i)] == r[:MAX_TOKENS]
