"""Rejection sampling is lossless: committed tokens are distributed as plain sampling from the target.

A tiny-vocabulary model (6 tokens) samples 3 tokens at temperature 1 (plain, or with penalties
and min_p, whose exact joint applies the hand-written formulas) for many seeded requests
batched in one engine; the first comes from the prefill, tokens 2-3 from DSpark verify steps
(drafts from the real drafter, whose q is a full distribution, or from a fixed deterministic
drafter, q one-hot). The exact target joint P(t1, t2, t3) is computed on the dense path (6 + 36
prefills) and the empirical joint is compared with a chi-square test (bins with expected count
< 5 merged), which must not reject at p = 1e-3. The unit tests check the accept rule and the
residual distribution against their closed forms.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvshare.config import ModelConfig
from kvshare.engine.engine import LLMEngine
from kvshare.engine.sampling import Sampler, SamplingParams
from kvshare.engine.spec_accept import verify
from kvshare.model.deepseek import Transformer
from kvshare.model.dspark import attach_dspark
from kvshare.shipped import resolve_config_path

from test_sampling_penalties import hand_penalised
from test_speculative_exact import prefill_logits

VOCAB, N_RUNS, PROMPT = 6, 3000, [1, 4, 2, 3, 0, 4, 1]


def tiny_vocab_model(temperature_scale: float) -> Transformer:
    raw = json.loads(resolve_config_path("tiny-v41-dspark").read_text())
    raw.update(vocab_size=VOCAB, dspark_noise_token_id=VOCAB - 1)
    cfg = ModelConfig.from_dict(raw)
    m = Transformer(cfg, quant=False)
    attach_dspark(m)
    m.init_weights(2)
    with torch.no_grad():  # flatten the head so every token keeps real probability
        m.head.weight.mul_(temperature_scale)
    return m.double().eval()


# Penalties and min_p for the "penalised" case; the exact joint applies them by hand.
PENALISED = dict(repetition_penalty=1.3, frequency_penalty=0.8, presence_penalty=0.3, min_p=0.4)


def target(logits: torch.Tensor, output: list[int], penalised: bool) -> torch.Tensor:
    """Plain sampling's distribution at temperature 1: hand-written penalties (OpenAI / vLLM
    semantics), then min_p (drop tokens with probability < min_p x the top one), then softmax."""
    if not penalised:
        return torch.softmax(logits, -1)
    x = torch.tensor(hand_penalised(logits.tolist(), PROMPT, output, PENALISED["repetition_penalty"],
                                    PENALISED["frequency_penalty"], PENALISED["presence_penalty"]), dtype=torch.float64)
    p = torch.softmax(x, -1)
    p = torch.where(p < PENALISED["min_p"] * p.max(), torch.zeros_like(p), p)
    return p / p.sum()


def exact_joint(model: Transformer, penalised: bool = False) -> dict[tuple[int, int, int], float]:
    p1 = target(prefill_logits(model, PROMPT), [], penalised)
    out = {}
    for a in range(VOCAB):
        p2 = target(prefill_logits(model, PROMPT + [a]), [a], penalised)
        for b in range(VOCAB):
            p3 = target(prefill_logits(model, PROMPT + [a, b]), [a, b], penalised)
            for c in range(VOCAB):
                out[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    return out


def chi_square_p(counts: dict, probs: dict, n: int) -> float:
    """p-value of Pearson's chi-square, merging bins (in increasing expectation) until each >= 5."""
    keys = sorted(probs, key=lambda k: probs[k])
    obs, exp, o_acc, e_acc = [], [], 0, 0.0
    for k in keys:
        o_acc += counts.get(k, 0)
        e_acc += probs[k] * n
        if e_acc >= 5:
            obs.append(o_acc)
            exp.append(e_acc)
            o_acc, e_acc = 0, 0.0
    obs[-1] += o_acc
    exp[-1] += e_acc
    o, e = torch.tensor(obs, dtype=torch.float64), torch.tensor(exp, dtype=torch.float64)
    stat = ((o - e) ** 2 / e).sum()
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize("drafter", ["dspark", "fixed", "penalised"])
def test_committed_tokens_follow_the_target_distribution(drafter):
    model = tiny_vocab_model(0.4)
    eng = LLMEngine(model, speculative_config={"method": "dspark", "num_speculative_tokens": 2},
                    max_num_seqs=512, max_num_batched_tokens=8192, block_size=8, num_blocks=1100)
    if drafter == "fixed":
        eng.speculator.draft_override = lambda seq, k: [3] * k
    for s in range(N_RUNS):
        extra = PENALISED if drafter == "penalised" else {}
        eng.add_request(str(s), PROMPT, SamplingParams(temperature=1.0, max_tokens=3, seed=s, ignore_eos=True,
                                                       **extra))
    counts: dict = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    st = eng.stats().extra
    assert 0.1 < st["spec_accepted_tokens"] / st["spec_draft_tokens"] < 0.9, st  # both branches exercised
    p = chi_square_p(counts, exact_joint(model, penalised=drafter == "penalised"), N_RUNS)
    # Observed: p = 0.66 (dspark, 81% of drafts accepted), 0.45 (fixed, 15%), 0.56 (penalised,
    # 63%); bonus always drawn from p instead of the residual gives p = 4e-5 and 4e-38; verifying
    # on unpenalised rows gives p = 1e-252, dropping min_p from the target gives p = 0.
    print(f"[{drafter}] chi-square p = {p:.3g}, accepted {st['spec_accepted_tokens'] / st['spec_draft_tokens']:.2f}")
    assert p > 1e-3, f"chi-square rejects the target distribution (p = {p:.2e})"


def test_accept_rule_and_residual_match_closed_forms():
    """One draft over 4 tokens, many independent rows: P(accept) = sum_x q(x) min(1, p/q) and the
    committed token's law is p (accepted draft or residual bonus)."""
    p = torch.tensor([0.1, 0.4, 0.3, 0.2])
    q = torch.tensor([0.4, 0.1, 0.3, 0.2])
    n = 40000
    g = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(q.expand(n, 4), 1, generator=g)
    logits = torch.log(p).expand(n, 2, 4).clone()
    params = [SamplingParams(temperature=1.0)] * n
    k, bonus = verify(logits, drafts, torch.ones(n, dtype=torch.int64), q.expand(n, 1, 4), params,
                      [str(i) for i in range(n)], Sampler(seed=1))
    accept = torch.minimum(torch.ones(4), p / q)
    assert abs(k.float().mean().item() - float((q * accept).sum())) < 0.01  # 4-sigma ~ 0.0096
    token = torch.where(k == 1, drafts[:, 0], bonus)
    freq = torch.bincount(token, minlength=4).double() / n
    assert (freq - p.double()).abs().max().item() < 0.01
    rejected = bonus[k == 0]
    resid = (p - q).clamp(min=0)
    resid_freq = torch.bincount(rejected, minlength=4).double() / rejected.numel()
    assert (resid_freq - resid / resid.sum()).abs().max().item() < 0.02


def test_greedy_accepts_the_argmax_prefix():
    logits = torch.tensor([[[0., 3., 1.], [2., 0., 1.], [0., 0., 5.]]])
    params = [SamplingParams(temperature=0)]
    for drafts, want_k, want_bonus in (([1, 0], 2, 2), ([1, 2], 1, 0), ([2, 0], 0, 1)):
        k, b = verify(logits, torch.tensor([drafts]), torch.tensor([2]), None, params, ["r"], Sampler())
        assert (int(k), int(b)) == (want_k, want_bonus)
    k, b = verify(logits, torch.tensor([[1, 0]]), torch.tensor([1]), None, params, ["r"], Sampler())
    assert (int(k), int(b)) == (1, 0)  # only one draft verified: bonus from row 1
