"""Batch invariance (issue 24, ops/invariant.py): with ``batch_invariant`` a row's bits depend on its
own sequence only, in bf16 too.

Pieces, each against an independent computation:
* `row_linear` gives every row the bits of that row multiplied alone, in calls of 1..300 rows;
* `pointwise` gives an element the bits of the vector loop whatever the tensor's size (without it,
  torch's scalar tail changes sigmoid / softplus / silu bits: asserted, so the test can fail);
* `row_index_scores` equals the spec's formula written out in float64, and its rows do not depend on
  the other rows of the call;
Then the engine end to end, bf16: batched + chunked + preempted serving vs each request alone in one
chunk gives bitwise the same logits on every sampled row and the same greedy tokens (the V4.1 test
model with every role and a real candidate level, the V4 model with its every-entry HCA layer, and
the shipped model), and bf16 DSpark speculative greedy equals plain greedy.

Mutations caught (each run by hand): `matmul_t` as the plain product (fp32 mHC / gate rows move with
the row count: tiny-v4 and the shipped model fail end to end); `Linear` not routed through
`row_linear` (the K = 4096 bf16 unit test fails: rows of a 128-row call differ from alone);
`pointwise` without its padding (its unit test fails). Not caught end to end at these sizes: the
attention's per-row path switched off (torch's batched products happen to agree here; the per-row
path is what makes that hold by construction) and `pointwise` unpadded (no flip at these sizes; seen
on the cand model with 16-token blocks while this was written).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kvshare.config import load_config
from kvshare.engine.engine import LLMEngine
from kvshare import kernels
from kvshare.engine.sampling import SamplingParams
from kvshare.layers import KernelChoice
from kvshare.llm import LLM
from kvshare.model import Transformer
from kvshare.model.dspark import attach_dspark
from kvshare.ops import invariant
from kvshare.ops.index_scores import row_index_scores
from test_model_common import cand_config

ROW_COUNTS = (1, 2, 7, 8, 33, 300)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(24, 1024), (259, 256), (96, 4096), (33, 77)])
def test_row_linear_gives_each_row_its_alone_bits(dtype: torch.dtype, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(max(ROW_COUNTS), k, generator=g).to(dtype)
    alone = torch.cat([invariant.row_linear(x[r:r + 1], w) for r in range(x.shape[0])])
    for m in ROW_COUNTS:
        assert torch.equal(invariant.row_linear(x[:m], w), alone[:m]), m
    exact = (x.double() @ w.double().t())
    # the product, not noise: observed max |alone - exact| / max |exact| 3.5e-3 (bf16 output); fp32 3.4e-7
    # (torch fallback) and 1.6e-6 (native kernels: one sequential fma chain per output over K = 1024)
    assert (alone.double() - exact).abs().max() <= (8e-3 if dtype == torch.bfloat16 else 4e-6) * exact.abs().max()


def test_a_parameters_cached_pack_follows_its_updates() -> None:
    """`row_linear` keeps a parameter's packed copy on the parameter; an in-place update, a replaced
    ``.data`` and a dtype change each give the new weight's product (compared with F.linear on
    FP8-valued fp32 inputs, where every order gives the same exact sum). Mutations caught: the
    parameter's own pack returned without checking its key (fails at "inplace"), and the pack key
    without the address (a replaced ``.data`` restarts the version counter at 0 and got the first
    weight's pack: fails at "data"; the code had that bug until this test)."""
    from kvshare import kernels

    if not kernels.available():
        pytest.skip("native kernels not built here")
    g = torch.Generator().manual_seed(0)
    exact = lambda *shape: torch.randint(-8, 9, shape, generator=g).float() / 8  # noqa: E731
    w = torch.nn.Parameter(exact(24, 40), requires_grad=False)
    x = exact(3, 40)
    for change in (None, "inplace", "data", "dtype"):
        if change == "inplace":
            w.mul_(-2)
        elif change == "data":
            w.data = exact(24, 40)
        elif change == "dtype":
            w.data = w.data.to(torch.bfloat16)
            x = x.to(torch.bfloat16)
        assert torch.equal(invariant.row_linear(x, w), F.linear(x, w)), change


def test_bf16_linear_module_rows_do_not_depend_on_the_call_in_a_batch_invariant_forward() -> None:
    """oneDNN's bf16 product is not row-invariant at K = 4096 (rows of a 128-row call differ
    from that row alone on an AMX Xeon); bound batch-invariant, `Linear` is."""
    from kvshare.layers.linear import Linear, pack_linears

    g = torch.Generator().manual_seed(0)
    lin = Linear(4096, 1536)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(1536, 4096, generator=g))
    lin = lin.to(torch.bfloat16)
    pack_linears(lin)
    lin.bind(KernelChoice(batch_invariant=True, gemm=kernels.available()))
    x = torch.randn(128, 4096, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([lin(x[r:r + 1]) for r in range(x.shape[0])])
        whole = lin(x)
    assert torch.equal(whole, alone)


@pytest.mark.parametrize("fn", [torch.sigmoid, F.softplus, F.silu], ids=["sigmoid", "softplus", "silu"])
def test_pointwise_sends_every_element_through_the_vector_loop(fn) -> None:
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 4
    vector = fn(x)  # 4096 elements: no scalar tail
    alone = torch.cat([fn(x[i:i + 1]) for i in range(256)])  # one element: the scalar loop
    assert not torch.equal(alone, vector[:256]), "the scalar and vector loops agree: nothing to guard"
    for n in (1, 3, 37, 100, 255):  # a batch-invariant caller
        assert torch.equal(invariant.pointwise(fn, x[:n], True), vector[:n]), n
    assert torch.equal(invariant.pointwise(fn, x[:37], False), fn(x[:37]))  # off: the plain call


def _buckets(n_valid: torch.Tensor, bucket: int = invariant.BUCKET) -> list[tuple[int, torch.Tensor]]:
    """Rows grouped by their count rounded up to a multiple of `bucket` (written out here, the
    engine's come from StepAddresses.length_buckets)."""
    b = [max(bucket, -(-int(n) // bucket) * bucket) for n in n_valid]
    return [(v, torch.tensor([r for r, x in enumerate(b) if x == v])) for v in sorted(set(b))]


def test_row_index_scores_match_the_formula_and_ignore_the_other_rows() -> None:
    g = torch.Generator().manual_seed(3)
    t, h, d, n, length = 9, 16, 8, 2, 150
    q = torch.randn(t, h, d, generator=g, dtype=torch.float64)
    w = torch.randn(t, h, generator=g, dtype=torch.float64)
    keys = torch.randn(n, length, d, generator=g, dtype=torch.float64)
    seq = torch.tensor([0, 0, 1, 1, 1, 0, 1, 0, 1])
    n_valid = torch.tensor([1, 63, 64, 65, 130, 150, 7, 128, 100])
    got = row_index_scores(q, w, keys, seq, _buckets(n_valid))
    for r in range(t):
        for j in range(int(n_valid[r])):
            want = sum(float(w[r, i]) * max(0.0, float(q[r, i] @ keys[seq[r], j])) for i in range(h))
            assert abs(float(got[r, j]) - want) <= 1e-5 * (1 + abs(want))  # fp32 result of a float64 sum
    q32, w32, k32 = q.float(), w.float(), keys.float()
    full = row_index_scores(q32, w32, k32, seq, _buckets(n_valid))
    for r in range(t):
        one = row_index_scores(q32[r:r + 1], w32[r:r + 1], k32, seq[r:r + 1], _buckets(n_valid[r:r + 1]))
        assert torch.equal(one[0, :int(n_valid[r])], full[r, :int(n_valid[r])]), r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_index_scores_of_one_sequence_are_those_beside_another(dtype: torch.dtype) -> None:
    """A single sequence's rows (keys shared by every row: a stride-0 batch, no per-row copy of the
    keys) get the bits they get beside another sequence's rows (the keys gathered per row): each row
    is the same [H, d] x [d, B] product either way. Index-sized heads (32 x 128), a budget small
    enough to split a bucket over several products. Mutation caught: the shared keys one row off
    (``kp[0, :b].roll(1, 0)``: both dtypes)."""
    g = torch.Generator().manual_seed(5)
    t, h, d, length = 40, 32, 128, 300
    q = torch.randn(t, h, d, generator=g).to(dtype)
    w = torch.randn(t, h, generator=g)
    keys = torch.randn(2, length, d, generator=g).to(dtype)
    n_valid = torch.arange(t) * 7 + 20  # 20 .. 293: several buckets
    alone = row_index_scores(q, w, keys[:1], torch.zeros(t, dtype=torch.int64), _buckets(n_valid), budget=1 << 18)
    seq = torch.tensor([0, 1] * (t // 2))
    other = torch.cat([keys[:1], keys[:1]])  # sequence 1 holds the same keys: every row's expected bits are alone's
    mixed = row_index_scores(q, w, other, seq, _buckets(n_valid), budget=1 << 18)
    for r in range(t):
        assert torch.equal(alone[r, :int(n_valid[r])], mixed[r, :int(n_valid[r])]), r


def test_step_addresses_bucket_rows_by_their_own_causal_count() -> None:
    """Written out: rows at positions p of ratio 2 have (p + 1) // 2 entries, rounded up to 4."""
    from kvshare.step import StepBatch

    batch = StepBatch.build([0, 9], [5, 3])  # positions 0-4 and 9-11
    got = [(b, rows.tolist()) for b, rows in batch.addresses().length_buckets(2, 4)]
    # counts 0, 1, 1, 2, 2 | 5, 5, 6 -> buckets 4, 4, 4, 4, 4 | 8, 8, 8
    assert got == [(4, [0, 1, 2, 3, 4]), (8, [5, 6, 7])]


def _model(name: str) -> Transformer:
    if name == "cand":
        return Transformer(cand_config(), quant=True).init_weights(4).eval().to(torch.bfloat16)
    if name == "kvshare-mini-v41":
        from kvshare.weights.loader import load_model

        return load_model(name, dtype=torch.bfloat16, quant=True)
    return Transformer(load_config(name), quant=True).init_weights(4).eval().to(torch.bfloat16)


preempted = [0]


def _serve(model: Transformer, prompts: list[list[int]], n_tokens: int, **kw) -> tuple[list[list[int]], dict]:
    """Greedy tokens and every sampled logits row, keyed (prompt index, output position)."""
    eng = LLMEngine(model, batch_invariant=True, **kw)
    assert eng.batch_invariant
    rows: dict[tuple[int, int], torch.Tensor] = {}
    run = eng.runner.run

    def spy(chunks):
        logits, sampling = run(chunks)
        for row, i in enumerate(sampling):
            s = chunks[i].seq
            rows[(int(s.request_id), len(s.output_token_ids))] = logits[row].clone()
        return logits, sampling

    eng.runner.run = spy
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True))
    done: dict[str, list[int]] = {}
    with torch.inference_mode():
        while eng.has_unfinished_requests():
            done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    preempted[0] = eng.stats().num_preemptions if len(prompts) > 1 else preempted[0]
    return [done[str(i)] for i in range(len(prompts))], rows


@pytest.mark.parametrize("name", ["cand", "tiny-v4", "kvshare-mini-v41"])
def test_bf16_batched_chunked_preempted_equals_alone_bitwise(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(name)
    rng = random.Random(9)
    lens = (35, 3, 21, 40, 12)
    pool = {"block_size": 8, "num_blocks": 8}  # 7 usable blocks of 8 for 5 requests of <= 46 tokens: preemption
    if name == "tiny-v4":  # its ratio-128 HCA layer: rows of 1 and 2 entries in buckets of 1, so two buckets
        monkeypatch.setattr(invariant, "BUCKET", 1)
        lens += (150, 300)
        pool = {"block_size": 128, "num_blocks": 4}
    prompts = [[rng.randrange(model.cfg.vocab_size - 1) for _ in range(n)] for n in lens]
    n_tokens = 6
    batched, rows_b = _serve(model, prompts, n_tokens, **pool, max_num_seqs=4, max_num_batched_tokens=13)
    for i, p in enumerate(prompts):
        alone, rows_a = _serve(model, [p], n_tokens, max_num_seqs=1, max_num_batched_tokens=256)
        assert alone[0] == batched[i], i
        for k in range(n_tokens):
            assert torch.equal(rows_a[(0, k)], rows_b[(i, k)]), (i, k)
    if name != "tiny-v4":
        assert preempted[0] > 0, "the pool was meant to be too small for every request at once"


def test_bf16_speculative_greedy_equals_plain_greedy() -> None:
    cfg = load_config("tiny-v41-dspark")
    model = Transformer(cfg, quant=True)
    attach_dspark(model)
    model = model.init_weights(1).eval().to(torch.bfloat16)
    rng = random.Random(13)
    prompts = [[rng.randrange(cfg.vocab_size - 1) for _ in range(n)] for n in (1, 7, 19, 33, 12)]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    plain = LLM(model, batch_invariant=True, max_num_seqs=4, max_num_batched_tokens=7)
    spec = LLM(model, batch_invariant=True, max_num_seqs=4, max_num_batched_tokens=7,
               speculative_config={"method": "dspark", "num_speculative_tokens": 5})
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert spec.engine.stats().extra["spec_num_verifies"] > 0
