"""DSpark speculative decoding: decode tokens/s with and without speculation, same model, same run.

The model is the V4.1-shaped benchmark stack plus 3 DSpark stages (random weights). Random draft
weights accept almost nothing, so the speed-up per accepted token is measured with a drafter that
agrees at a known rate: the engine's ``draft_override`` hook returns the target's own greedy
continuation (from the plain run) for j tokens, then wrong tokens, so every verify commits
exactly j + 1 tokens (j = 0 .. K; fewer at the end, where max_tokens caps the drafts). The real
DSpark drafter runs too (its cost per step: the draft forward of 3 stages plus the Markov loop).
Every speculative run must produce the plain run's tokens (lossless); the measured mean accepted
length must equal `expected_accepted_length`.

Decode tokens/s = generated tokens after each sequence's first / wall time from the step after
prefill to the last step. The runs follow each other in one process (a shared machine's load can
differ between them; the header records it).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from kvshare.bench.gen import equal_length_prompts
from kvshare.bench.kv_runner import DTYPES, greedy, make_engine
from kvshare.bench.report import Section, Target
from kvshare.bench.sizes import BenchSizes, v41_config
from kvshare.config import ModelConfig

K = 5
STAGES = 3


def spec_config(s: BenchSizes) -> dict[str, Any]:
    """The V4.1-shaped benchmark config with 3 DSpark stages tapping its last three layers."""
    d = v41_config(s)
    n = d["num_hidden_layers"]
    d.update({"compress_ratios": d["compress_ratios"] + [0] * STAGES, "num_nextn_predict_layers": STAGES,
              "dspark_block_size": K, "dspark_noise_token_id": d["vocab_size"] - 1,
              "dspark_target_layer_ids": [n - 3, n - 2, n - 1], "dspark_markov_rank": 16})
    return d


def _run(model: Any, prompts: torch.Tensor, new_tokens: int, spec: bool, dtype: str, device: str,
         override: Callable | None) -> tuple[list[list[int]], float, dict[str, float]]:
    """(tokens per sequence, decode tokens/s, spec stats) of one greedy generation."""
    b, length = prompts.shape
    eng = make_engine(model, batch=b, max_len=length + new_tokens + K + 1, block_size=64, dtype=dtype,
                      device=device)
    if spec:
        eng = type(eng)(model, args=eng.args, speculative_config={"method": "dspark", "num_speculative_tokens": K})
        eng.speculator.draft_override = override
    ids = [f"s{i}" for i in range(b)]
    for rid, p in zip(ids, prompts.tolist()):
        eng.add_request(rid, p, greedy(new_tokens))
    tokens: dict[str, list[int]] = {}
    t_first = None
    while eng.has_unfinished_requests():
        outs = eng.step()
        for o in outs:
            tokens[o.request_id] = list(o.token_ids)
        if t_first is None and len(tokens) == b and all(tokens.values()):
            t_first = time.perf_counter()
    elapsed = time.perf_counter() - (t_first or time.perf_counter())
    gen = b * (new_tokens - 1)
    return [tokens[r] for r in ids], gen / elapsed if elapsed > 0 else float("nan"), dict(eng.stats().extra)


def expected_accepted_length(new_tokens: int, agree: int) -> float:
    """Mean tokens per verify of one sequence whose drafter is right for `agree` tokens: each verify
    gets K_i = min(K, tokens left - 1) drafts and commits min(agree, K_i) + 1 (the last plain decode,
    with one token left, drafts nothing and is not a verify)."""
    left, steps, total = new_tokens - 1, 0, 0
    while left > 1:
        n = min(agree, K, left - 1) + 1
        steps, total, left = steps + 1, total + n, left - n
    return total / steps if steps else 1.0


def _oracle(ref: dict[tuple[int, ...], list[int]], agree: int, vocab: int) -> Callable:
    def draft(seq: Any, k: int) -> list[int]:
        cont = ref[tuple(seq.prompt_token_ids)]
        n = len(seq.output_token_ids)
        return (cont[n:n + agree] + [(t + 1) % (vocab - 1) for t in cont[n + agree:n + k]])[:k]
    return draft


def speculation_section(s: BenchSizes, *, dtype: str, device: str) -> Section:
    from kvshare.model.deepseek import Transformer
    from kvshare.model.dspark import attach_dspark

    cfg = ModelConfig.from_dict(spec_config(s))
    model = Transformer(cfg, quant=False)
    attach_dspark(model)
    model = model.init_weights(s.seed).to(device=device, dtype=DTYPES[dtype]).eval()
    new_tokens = max(s.new_tokens, 4 * (K + 1))
    b = 1
    prompts = equal_length_prompts(b, s.prompt_len, cfg.vocab_size, s.seed, avoid=(cfg.dspark_noise_token_id,))
    base_toks, base_tps, _ = _run(model, prompts, new_tokens, False, dtype, device, None)
    ref = {tuple(p): t for p, t in zip(prompts.tolist(), base_toks)}
    sec = Section("speculation", f"DSpark speculative decoding, V4.1-shaped {s.v41_layers} layers + {STAGES} "
                  f"stages, batch {b}, prompt {s.prompt_len}, {new_tokens} new tokens, K = {K}",
                  ["drafter", "accepted / step", "mean accepted length", "decode tok/s", "vs plain", "lossless"])
    sec.rows.append(["none (plain decode)", "-", 1.0, round(base_tps, 1), 1.0, True])
    rows = []
    for label, agree in [("DSpark (random weights)", None)] + [(f"agrees for {j} of {K}", j) for j in (0, 2, 5)]:
        override = None if agree is None else _oracle(ref, agree, cfg.vocab_size)
        toks, tps, st = _run(model, prompts, new_tokens, True, dtype, device, override)
        mal = st.get("spec_mean_accepted_length", float("nan"))
        same = toks == base_toks
        sec.rows.append([label, "-" if agree is None else agree, round(mal, 2), round(tps, 1),
                         round(tps / base_tps, 2), same])
        rows.append({"drafter": label, "agree": agree, "decode_tok_s": tps, "mean_accepted_length": mal,
                     "speedup": tps / base_tps, "lossless": same, **st})
        sec.targets.append(Target(f"lossless: {label}", float(same), 1.0, "=="))
        if agree is not None:
            sec.targets.append(Target(f"mean accepted length, {label}", mal,
                                      expected_accepted_length(new_tokens, agree), "==",
                                      "agree + 1 per verify, fewer only where max_tokens caps the drafts"))
    sec.data = {"plain_decode_tok_s": base_tps, "rows": rows, "new_tokens": new_tokens, "k": K}
    sec.notes.append("Speed-up per accepted token on this machine: compare 'agrees for j' rows; a verify of "
                     "K + 1 tokens costs more than one decode step, so j = 0 measures the overhead.")
    return sec
