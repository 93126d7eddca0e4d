"""MAIN exactness: the paged, batched, chunked, preempting engine == each request alone on the dense path.

For tiny-v41, tiny-v41-deep and tiny-v4 with random fp32 weights, quant off (fp32 rows) and quant on
(the real packed fp4 / fp8 rows), several requests of random lengths are submitted together with a
random token budget (so prompts are split into random chunks and mixed with decodes) and a pool
too small for all of them (so sequences are preempted and recomputed). Every greedy token must
equal the reference (Transformer + DenseCache, prefill then decode, one request at a time) and
every sampled row's logits must be within LOGIT_TOL of the reference's.
"""

from __future__ import annotations

import os
import random
import zlib

import pytest
import torch

from kvshare.cache.formats import formats_for
from kvshare.config import load_config
from kvshare.engine.engine import LLMEngine
from kvshare.engine.sampling import SamplingParams
from kvshare.model.deepseek import Transformer
from kvshare.cache.dense import DenseCache
from kvshare.model.quantize import KVQuantizer
from kvshare.step import StepBatch

pytestmark = pytest.mark.usefixtures("small_prefill_paths")  # prefill runs its fast paths

MAX_TOKENS = 4
PROMPT_SEED = int(os.environ.get("KVSHARE_TEST_PROMPT_SEED", "0"))  # vary to explore other prompts
# fp32 reduction order differs between batch shapes (~1e-6). With quant on, fake-quant could turn
# such a difference into a flipped fp8 / fp4 rounding step, so quant-on cases run in float64:
# batch-shape noise (~1e-16) then never reaches a rounding boundary, and the bound is fp32 rounding.
# Observed max |diff| (PROMPT_SEED 0): fp32 5.1e-6 (tiny-v41-deep), float64 0 (logits come back fp32,
# so 1e-6 allows ~2 fp32 ulps of a float64 difference).
LOGIT_TOL = {False: 2e-5, True: 1e-6}
PROMPT_LENS = {"v41": [1, 7, 19, 33, 12], "v4": [126, 3, 20, 127, 9]}


def reference(model: Transformer, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and their logits rows, one request alone: prefill, then token-by-token decode."""
    cache = DenseCache(model.cfg, model.topo, 1, len(prompt) + n + 1)
    toks, out, rows = list(prompt), [], []
    batch = StepBatch.build([0], [len(toks)], [0], logit_rows=[len(toks) - 1])
    logits = model(torch.tensor(toks), batch, cache)
    for _ in range(n):
        rows.append(logits[-1])
        out.append(int(logits[-1].argmax()))
        if len(out) == n:
            break
        toks.append(out[-1])
        logits = model(torch.tensor([out[-1]]), StepBatch.build([len(toks) - 1], [1], [0]), cache)
    return out, torch.stack(rows)


_CACHE: dict[tuple[str, bool], tuple] = {}




def case(name: str, quant: bool):
    """(model, prompts, reference tokens, reference logits), built once per session."""
    if (name, quant) not in _CACHE:
        cfg = load_config(name)
        model = Transformer(cfg, quant=quant).init_weights(1).eval()
        if quant:
            model = model.double()
        rng = random.Random(zlib.crc32(name.encode()) + PROMPT_SEED)
        prompts = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in PROMPT_LENS[cfg.arch]]
        with torch.inference_mode():
            refs = [reference(model, p, MAX_TOKENS) for p in prompts]
        _CACHE[(name, quant)] = (model, prompts, refs)
    return _CACHE[(name, quant)]


def packed_formats_lossless(model: Transformer) -> bool:
    """Whether the architecture's packed rows store this model's fake-quantised rows exactly."""
    cfg = model.cfg
    kv, ik, win = formats_for(cfg)
    q = KVQuantizer(cfg, model.quant)
    x = torch.randn(64, cfg.head_dim, generator=torch.Generator().manual_seed(0))
    w, c = q.window(x), q.compressed(x)
    return bool((win.unpack(win.pack(w)) == w).all() and (kv.unpack(kv.pack(c)) == c).all())


def spy_logits(eng: LLMEngine) -> dict[tuple[str, int], torch.Tensor]:
    """A dict the engine's runner fills with every sampled logits row, keyed (request id, tokens so far)."""
    rows: dict[tuple[str, int], torch.Tensor] = {}
    run = eng.runner.run

    def spy(chunks):
        logits, sampling = run(chunks)
        for row, i in enumerate(sampling):
            s = chunks[i].seq
            rows[(s.request_id, len(s.output_token_ids))] = logits[row].clone()
        return logits, sampling

    eng.runner.run = spy
    return rows


def greedy_random_run(eng: LLMEngine, vocab: int, lens, seed: int, max_tokens: int = 10) -> dict[str, list[int]]:
    """Requests "0", "1", ... of random token ids below ``vocab - 1`` (lengths `lens`, drawn from
    ``random.Random(seed)``), greedy with ignore_eos, stepped to the end in inference mode; each
    request's output tokens."""
    rng = random.Random(seed)
    for i, n in enumerate(lens):
        eng.add_request(str(i), [rng.randrange(vocab - 1) for _ in range(n)],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    done: dict[str, list[int]] = {}
    with torch.inference_mode():
        while eng.has_unfinished_requests():
            done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    return done


def run_engine(model, prompts, **kw) -> tuple[dict[str, list[int]], dict[tuple[str, int], torch.Tensor], LLMEngine]:
    eng = LLMEngine(model, **kw)
    captured = spy_logits(eng)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    done: dict[str, list[int]] = {}
    steps = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                assert o.finish_reason == "length"
                done[o.request_id] = o.token_ids
        steps += 1
        assert steps < 500
    assert eng.blocks.allocator.num_used == 0 and eng.blocks.slots.num_free == eng.blocks.slots.num_slots
    return done, captured, eng


CASES = [(n, q) for n in ("tiny-v41", "tiny-v41-deep", "tiny-v4") for q in (False, True)]


@pytest.mark.parametrize("name,quant", CASES)
def test_batched_chunked_preempted_engine_matches_dense_reference(name, quant):
    model, prompts, refs = case(name, quant)
    cfg = model.cfg
    rng = random.Random(f"{name}-{quant}")
    kw: dict = {}
    if quant and not packed_formats_lossless(model):
        # The packed rows would round values the model keeps (reported); store them exactly instead.
        kw["kv_format"] = ("fp32", "fp4", "fp32")
    if cfg.arch == "v4":
        block_size, num_blocks = 128, 4  # 3 usable blocks; sequences crossing 128 tokens force preemption
    else:
        block_size, num_blocks = 8, 6  # 5 usable blocks of 8 for 5 requests of up to 37 tokens
    budget = rng.randint(5, 24)
    done, logits, eng = run_engine(model, prompts, block_size=block_size, num_blocks=num_blocks,
                                   max_num_seqs=4, max_num_batched_tokens=budget, **kw)
    st = eng.stats()
    assert st.num_preemptions > 0, "the pool was meant to be too small"
    for i, (toks, rows) in enumerate(refs):
        assert done[str(i)] == toks, f"request {i} (prompt {len(prompts[i])} tokens), budget {budget}"
        for k in range(MAX_TOKENS):
            diff = (logits[(str(i), k)] - rows[k]).abs().max().item()
            assert diff < LOGIT_TOL[quant], f"request {i} token {k}: logits differ by {diff}"


@pytest.mark.parametrize("name", ["tiny-v41", "tiny-v41-deep"])
def test_unshared_cache_gives_the_same_tokens(name):
    """share_kv_cache=False: every layer its own copy (more bytes per block), identical math."""
    model, prompts, refs = case(name, False)
    done, _, eng = run_engine(model, prompts, block_size=8, num_blocks=40, max_num_seqs=5,
                              max_num_batched_tokens=64, share_kv_cache=False)
    cfg = model.cfg
    # Independent count: fp32 rows (4 B per value); every compressed layer keeps block/ratio rows of
    # compressed KV and of index keys (every V4.1 compressed layer attends a top-k selection).
    row = 4 * (cfg.head_dim + cfg.index_head_dim)
    assert not eng.layout.share_cache
    assert eng.pool.block_bytes == 40 * sum(8 // r * row for r in cfg.compress_ratios[:cfg.num_hidden_layers] if r)
    for i, (toks, _) in enumerate(refs):
        assert done[str(i)] == toks


@pytest.mark.parametrize("budget", [1, 256])
def test_token_by_token_and_one_chunk_prefill_agree(budget):
    """Budget 1: every prompt token is its own step; budget 256: each prompt in one chunk, all batched."""
    model, prompts, refs = case("tiny-v41", True)
    done, logits, _ = run_engine(model, prompts, block_size=16, num_blocks=30, max_num_seqs=5,
                                 max_num_batched_tokens=budget)
    for i, (toks, rows) in enumerate(refs):
        assert done[str(i)] == toks
        assert max((logits[(str(i), k)] - rows[k]).abs().max().item() for k in range(MAX_TOKENS)) < LOGIT_TOL[True]
