"""Engram through the paged engine: `LLM.generate` on tiny-v41-engram equals the dense reference.

Several prompts run together with a small token budget (chunked prefill mixed with decodes) and a
pool too small for all of them (preemption and recompute), and again with a roomy pool; every
greedy token and every sampled token's logprob must equal the dense path's (prefill, then decode
one token at a time with its previous ids): quantisation off in fp32 (the pool stores fp32 rows),
quantisation on in float64 (so batch-shape noise cannot flip an FP8/FP4 rounding).
"""

from __future__ import annotations

import random

import pytest
import torch

from kvshare.config import load_config
from kvshare.engine.sampling import SamplingParams
from kvshare.llm import LLM
from kvshare.cache.dense import DenseCache
from kvshare.model import Transformer
from kvshare.step import StepBatch
from test_engine_exact import packed_formats_lossless

NAME = "tiny-v41-engram"
MAX_TOKENS = 5
PROMPT_LENS = [1, 7, 19, 30, 12]
# logprob tolerance: fp32 model, observed 1.7e-6 (batch-shape noise); float64 model with fp32
# logits and logprobs, observed 1.4e-7
TOL = {False: 1e-5, True: 1e-6}


def dense_reference(model: Transformer, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs: prefill, then decode with the last 3 ids as look-back."""
    cache = DenseCache(model.cfg, model.topo, 1, len(prompt) + MAX_TOKENS + 1, dtype=model.embed.weight.dtype)
    toks, out, lps = list(prompt), [], []
    with torch.no_grad():
        logits = model(torch.tensor(toks), StepBatch.build([0], [len(toks)]), cache)[-1]
        for _ in range(MAX_TOKENS):
            lp = torch.log_softmax(logits.double(), -1)
            out.append(int(logits.argmax()))
            lps.append(float(lp[out[-1]]))
            toks.append(out[-1])
            s = len(toks) - 1
            logits = model(torch.tensor([out[-1]]), StepBatch.build([s], [1], prev_tokens=[toks[max(0, s - 3):s]]), cache)[-1]
    return out, lps


@pytest.mark.parametrize("quant", [False, True], ids=["plain", "quant"])
def test_generate_preempted_chunked_batched_equals_dense(quant: bool) -> None:
    model = Transformer(load_config(NAME), quant=quant).init_weights(1).eval()
    model = model.double() if quant else model
    rng = random.Random(quant)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in PROMPT_LENS]
    refs = [dense_reference(model, p) for p in prompts]
    kw = {} if not quant or packed_formats_lossless(model) else {"kv_format": ("fp32", "fp4", "fp32")}
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=True)
    for engine_kw in ({"block_size": 8, "num_blocks": 6, "max_num_batched_tokens": rng.randint(5, 13)},
                      {"max_num_batched_tokens": 2048}):
        llm = LLM(model, max_num_seqs=4, **engine_kw, **kw)
        outs = llm.generate(prompts, params, use_tqdm=False)
        if "num_blocks" in engine_kw:
            assert llm.engine.stats().num_preemptions > 0, "the pool was meant to be too small"
        for i, (o, (toks, lps)) in enumerate(zip(outs, refs)):
            assert o.token_ids == toks, f"request {i} ({len(prompts[i])} prompt tokens), {engine_kw}"
            got = torch.tensor(o.logprobs, dtype=torch.float64)
            err = (got - torch.tensor(lps, dtype=torch.float64)).abs().max().item()
            assert err < TOL[quant], f"request {i} logprobs differ by {err}"
