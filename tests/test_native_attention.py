"""Paged attention with keys read in place (kernels/attn.py, csrc/attn.cpp, issue 26).

The kernel addresses every key itself (window positions from the step's rows or the slot's ring,
compressed entries through the block table) and then runs `decode.sparse_attention`'s arithmetic.
References, each written independently of the kernel's addressing:

* the same keys gathered here with plain Python indexing from the spec's address rules (ring row
  = position mod rows, entry j at block ``tables[seq, j r // B]`` row ``(j r % B) // r``) and fed
  to the native `sparse_attention`: bitwise equal (same keys, same order, same arithmetic);
* the spec's formula in float64 over those keys: bounded (observed errors stated below);
* whole engines (paged, batched, chunked prefill, decode past the ring's wrap), bf16 and fp32: the
  logits of every sampled row are bitwise those of the gather path (`PagedAttention.in_place` off).

Mutations caught (each run by hand while writing this; each failed the tests named): the ring row
``(x + 1) % rows`` (the engine tests, all four), the step row off by one (``first + x - start + 1``:
op tests and all four engine tests), the compressed row ``(pos % B) % (B / r)`` instead of
``(pos % B) / r`` (all four engine tests), the HCA count off by one (``compress_len - 1`` in the
model: both tiny-v4 engine tests), the sink left out of the denominator (the tiny-v41 engine tests).
"""

from __future__ import annotations

import random

import pytest
import torch

from kvshare.config import load_config
from kvshare.engine.engine import LLMEngine
from test_engine_exact import greedy_random_run, spy_logits
from kvshare.engine.sampling import SamplingParams
from kvshare.kernels import decode as native
from kvshare.kernels.attn import paged_attention
from kvshare.model import Transformer
from kvshare.layers.attention import PagedAttention

_IN_PLACE = PagedAttention.in_place  # the real method (the tests patch a counting wrapper in)

pytestmark = pytest.mark.skipif(not native.enabled(), reason="native kernels unavailable on this machine")


def _case(dtype: torch.dtype, t_rows: int, seed: int, d: int = 64, h: int = 4):
    """A synthetic step: 3 slots with rings of 11 rows (window 8), 4 sequences whose chunks start at
    odd positions (one prefill chunk crossing the window, decode rows, one sequence at position 2),
    a pool of 9 blocks of 16 tokens at ratio 4 (4 rows per block), block tables with a short row."""
    g = torch.Generator().manual_seed(seed)
    ring_rows, w, slots = 11, 8, 3
    esz = torch.empty(0, dtype=dtype).element_size()
    pad = 6  # bytes past the row's values (as a packed format's scale / pad bytes would be)
    ring_vals = torch.randn(slots, ring_rows, d, generator=g).to(dtype)
    ring = torch.zeros(slots, ring_rows, d * esz + pad, dtype=torch.uint8)
    ring[..., :d * esz] = ring_vals.view(torch.uint8).reshape(slots, ring_rows, d * esz)
    # chunks: (slot, start position, length)
    chunks = [(0, 30, t_rows - 3), (2, 2, 1), (1, 57, 1), (0, 5, 1)][: 1 + (t_rows > 1) * 3]
    if t_rows == 1:
        chunks = [(1, 40, 1)]
    meta, seq, first = [], [], 0
    for i, (slot, start, n) in enumerate(chunks):
        for r in range(n):
            meta.append([slot, start + r, start, first])
            seq.append(i)
        first += n
    t = len(meta)
    meta_t = torch.tensor(meta, dtype=torch.int64)
    step = torch.randn(t, d, generator=g).to(dtype)
    q = torch.randn(t, h, d, generator=g).to(dtype)
    sink = torch.randn(h, generator=g)
    nb, per, bsz, ratio = 9, 4, 16, 4
    pool_vals = torch.randn(nb, per, d, generator=g).to(dtype)
    blocks = torch.zeros(nb, 100 + per * (d * esz + pad), dtype=torch.uint8)  # a region inside wider blocks
    view = torch.as_strided(blocks, (nb, per, d * esz + pad), (blocks.stride(0), d * esz + pad, 1), 37)
    view[..., :d * esz] = pool_vals.view(torch.uint8).reshape(nb, per, d * esz)
    tables = torch.tensor([[3, 1, 7, 2, 5], [8, 4, 6, 0, 0], [2, 6, 1, 3, 0], [5, 7, 0, 0, 0]], dtype=torch.int64)
    seq_t = torch.tensor(seq, dtype=torch.int64)
    return dict(q=q, ring=ring, ring_vals=ring_vals, step=step, meta=meta_t, w=w, sink=sink, view=view,
                pool_vals=pool_vals, tables=tables, seq=seq_t, ratio=ratio, bsz=bsz)


def _gathered(c: dict, picks: torch.Tensor | None):
    """The keys of every row gathered with Python indexing from the address rules (module doc)."""
    d, w, rows = c["step"].shape[1], c["w"], c["ring_vals"].shape[1]
    win, win_ok, comp, comp_ok = [], [], [], []
    for t, (slot, pos, start, first) in enumerate(c["meta"].tolist()):
        ks, ok = [], []
        for i in range(w):
            x = pos - w + 1 + i
            if x < 0:
                ks.append(torch.zeros(d, dtype=c["step"].dtype))
                ok.append(False)
            elif x >= start:
                ks.append(c["step"][first + x - start])
                ok.append(True)
            else:
                ks.append(c["ring_vals"][slot, x % rows])
                ok.append(True)
        win.append(torch.stack(ks))
        win_ok.append(ok)
        if picks is None:
            continue
        ks, ok = [], []
        for j in picks[t].tolist():
            p = j * c["ratio"]
            col = p // c["bsz"]
            if j < 0 or col >= c["tables"].shape[1]:
                ks.append(torch.zeros(d, dtype=c["step"].dtype))
                ok.append(False)
            else:
                blk = int(c["tables"][int(c["seq"][t]), col])
                ks.append(c["pool_vals"][blk, (p % c["bsz"]) // c["ratio"]])
                ok.append(True)
        comp.append(torch.stack(ks) if ks else torch.zeros(0, d, dtype=c["step"].dtype))
        comp_ok.append(ok)
    out = [torch.stack(win), torch.tensor(win_ok)]
    if picks is not None:
        out += [torch.stack(comp), torch.tensor(comp_ok, dtype=torch.bool).reshape(len(comp), -1)]
    return out


def _formula(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """spec/model.md §4.7 in float64."""
    s = torch.einsum("thd,tmd->thm", q.double(), keys.double()) * scale
    s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
    mx = torch.maximum(s.amax(-1), sink.double().expand(q.shape[0], -1))
    p = torch.exp(s - mx.unsqueeze(-1))
    return torch.einsum("thm,tmd->thd", p, keys.double()) / (p.sum(-1) + torch.exp(sink.double() - mx)).unsqueeze(-1)


def _picks(c: dict, m: int, seed: int) -> torch.Tensor:
    """Ascending picks per row, -1 padded, some past the short table row (invalid: masked)."""
    g = random.Random(seed)
    out = []
    for _ in range(c["q"].shape[0]):
        n = g.randrange(0, m + 1)
        js = sorted(g.sample(range(20), n))
        out.append(js + [-1] * (m - n))
    return torch.tensor(out, dtype=torch.int64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t_rows", [1, 8, 13])
@pytest.mark.parametrize("mode", ["window", "picks", "counts"])
def test_in_place_keys_give_the_bits_of_the_gathered_kernel(dtype: torch.dtype, t_rows: int, mode: str) -> None:
    c = _case(dtype, t_rows, seed=t_rows + 3 * (dtype == torch.float32))
    q, d = c["q"], c["q"].shape[-1]
    scale = d**-0.5
    t = q.shape[0]
    picks = counts = None
    if mode == "picks":
        picks = _picks(c, 7, t_rows)
    elif mode == "counts":
        counts = torch.tensor([(3 * r + 1) % 21 for r in range(t)], dtype=torch.int64)  # up to 20 = past the table
    pool_args = {} if mode == "window" else dict(pool=c["view"], tables=c["tables"], seq=c["seq"], picks=picks,
                                                 counts=counts, ratio=c["ratio"], block_size=c["bsz"])
    got = paged_attention(q, c["ring"], c["step"], c["meta"], c["w"], c["sink"], scale, **pool_args)
    if mode == "counts":  # every entry below the row's count, as picks
        m = int(counts.max())
        picks = torch.tensor([[j if j < n else -1 for j in range(m)] for n in counts.tolist()], dtype=torch.int64)
    keys = _gathered(c, picks)
    want = native.sparse_attention(q, *keys[:2], c["sink"], scale, *keys[2:])
    assert torch.equal(got, want)
    allk = torch.cat([keys[0], keys[2]], 1) if len(keys) > 2 else keys[0]
    allv = torch.cat([keys[1], keys[3]], 1) if len(keys) > 2 else keys[1]
    exact = _formula(q, allk, allv, c["sink"], scale)
    # observed max |got - exact| / max |exact| over these cases: fp32 2.4e-7, bf16 2.7e-3 (the output's rounding)
    tol = 8e-3 if dtype == torch.bfloat16 else 1e-6
    assert (got.double() - exact).abs().max() <= tol * exact.abs().max()
    for r in (0, t - 1):  # a row alone gives its bits in the call
        one = {k: (v[r:r + 1] if k in ("seq", "picks", "counts") and v is not None else v) for k, v in pool_args.items()}
        alone = paged_attention(q[r:r + 1], c["ring"], c["step"], c["meta"][r:r + 1], c["w"], c["sink"], scale, **one)
        assert torch.equal(alone, got[r:r + 1])


# (kind, format name, arch, rope dims) of the quantised rows the kernel decodes: V4's window / kv rows
# (e4m3 nope dims, bf16 rope dims, 48-value blocks at d = 64), V4.1's window rows (e4m3, blocks of 32)
# and kv rows (e2m1, e4m3 scales per 16)
_CODED = {"fp8_v4": ("window", "fp8_v4", "v4", 16), "fp8_v41": ("window", "fp8_v41", "v41", 0),
          "fp4": ("kv", "fp4", "v41", 0)}


def _store(vals: torch.Tensor, name: str, lead_bytes: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]:
    """(rows uint8 [A, B, row bytes + 3] in a strided view `lead_bytes` into wider blocks, the values
    torch's decoder reads from them in vals' dtype, the codec) of `vals` [A, B, d] stored in the format
    `name` (`_CODED`): the values made representable (`fake_quant`), then packed. The decoded values
    come from `unpack` without a dtype (torch's fp32 decoder, not the native codec the kernel shares),
    rounded to vals' dtype as a gather reads them."""
    from kvshare.cache.formats import row_format

    kind, fname, arch, rope = _CODED[name]
    fmt = row_format(kind, fname, vals.shape[-1], arch=arch, rope_dim=rope)
    packed = fmt.pack(fmt.fake_quant(vals.float()))
    a, b, width = *packed.shape[:2], fmt.row_bytes + 3
    blocks = torch.zeros(a, lead_bytes + 9 + b * width, dtype=torch.uint8)
    rows = torch.as_strided(blocks, (a, b, width), (blocks.stride(0), width, 1), lead_bytes)
    rows[..., :fmt.row_bytes] = packed
    return rows, fmt.unpack(packed).to(vals.dtype), fmt.codec


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ring_fmt,pool_fmt", [("fp8_v4", "fp8_v4"), ("fp8_v41", "fp4"), ("fp4", "fp8_v41"),
                                               ("fp8_v41", None)])
def test_quantised_rows_read_in_place_give_the_bits_of_the_decoded_gather(dtype: torch.dtype, ring_fmt: str,
                                                                          pool_fmt: str | None) -> None:
    """Ring and pool rows stored as FP8 / FP4 rows (V4's pair, V4.1's pair, the V4.1 formats swapped,
    a ring alone), decoded by the kernel as it reads them: bitwise the kernel over the rows torch's
    decoder gives, gathered by the address rules here. Mutations caught: the e4m3 exponent bias 119
    instead of 120 in `e4m3_to_f32` (every case), the fp4 nibbles swapped in `decode_row` (the cases
    with fp4 rows), the pool read with the ring's codec in the op (the V4.1 pairs; also the tiny-v41
    engine tests of tests/test_quantised_in_place.py)."""
    c = _case(dtype, 8, seed=11 + len(ring_fmt))
    q, d = c["q"], c["q"].shape[-1]
    c["ring"], c["ring_vals"], ring_codec = _store(c["ring_vals"], ring_fmt, 0)
    picks, pool_args = None, {}
    if pool_fmt is not None:
        c["view"], c["pool_vals"], pool_codec = _store(c["pool_vals"], pool_fmt, 11)
        picks = _picks(c, 6, 3)
        pool_args = dict(pool=c["view"], tables=c["tables"], seq=c["seq"], picks=picks, ratio=c["ratio"],
                         block_size=c["bsz"], pool_codec=pool_codec)
    got = paged_attention(q, c["ring"], c["step"], c["meta"], c["w"], c["sink"], d**-0.5, ring_codec=ring_codec,
                          **pool_args)
    keys = _gathered(c, picks)
    assert torch.equal(got, native.sparse_attention(q, *keys[:2], c["sink"], d**-0.5, *keys[2:]))


def test_a_row_layout_that_does_not_fit_is_refused() -> None:
    c = _case(torch.float32, 1, seed=2)
    ring, _, _ = _store(c["ring_vals"], "fp8_v41", 0)  # rows of 64 codes + 2 scale bytes + 3 pad = 69 bytes
    args = (c["q"], ring, c["step"], c["meta"], c["w"], c["sink"], 0.1)
    with pytest.raises(RuntimeError, match="ring's row layout"):
        paged_attention(*args, ring_codec=(2, 24, 0))  # 64 values in blocks of 24
    with pytest.raises(RuntimeError, match="ring must be uint8"):
        paged_attention(*args, ring_codec=(3, 8, 0))  # 64 e4m3 codes + 8 scale bytes: longer than the 69 stored


def test_threads_do_not_change_the_bits() -> None:
    c = _case(torch.bfloat16, 13, seed=5)
    args = (c["q"], c["ring"], c["step"], c["meta"], c["w"], c["sink"], 0.125)
    kw = dict(pool=c["view"], tables=c["tables"], seq=c["seq"], picks=_picks(c, 5, 1), ratio=4, block_size=16)
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_attention(*args, **kw)
        torch.set_num_threads(2)
        two = paged_attention(*args, **kw)
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(one, two)


def test_bad_addresses_are_refused_with_the_field() -> None:
    c = _case(torch.float32, 8, seed=1)
    args = (c["q"], c["ring"], c["step"])
    bad_slot = c["meta"].clone()
    bad_slot[2, 0] = 3
    with pytest.raises(RuntimeError, match="meta row 2"):
        paged_attention(*args, bad_slot, c["w"], c["sink"], 0.1)
    bad_first = c["meta"].clone()
    bad_first[0, 3] = 8  # its window reaches step row 8 of 8
    with pytest.raises(RuntimeError, match="meta row 0"):
        paged_attention(*args, bad_first, c["w"], c["sink"], 0.1)
    tables = c["tables"].clone()
    tables[1, 2] = 9
    with pytest.raises(RuntimeError, match="block table entry 9"):
        paged_attention(*args, c["meta"], c["w"], c["sink"], 0.1, pool=c["view"], tables=tables, seq=c["seq"],
                        counts=torch.ones(8, dtype=torch.int64), ratio=4, block_size=16)
    with pytest.raises(RuntimeError, match="window 12"):
        paged_attention(*args, c["meta"], 12, c["sink"], 0.1)


def _serve(name: str, dtype: torch.dtype, in_place: bool, monkeypatch: pytest.MonkeyPatch):
    """Greedy tokens and every sampled logits row of a paged engine (plain bf16 / fp32 cache rows,
    chunked prefill, batched decode past the window ring's wrap), with the in-place attention on or
    off; and how many forwards took the in-place path."""
    model = Transformer(load_config(name), quant=False).init_weights(3).eval().to(dtype)
    calls = [0]
    real = _IN_PLACE

    def counted(self, *a):
        o = real(self, *a) if in_place else None
        calls[0] += o is not None
        return o

    monkeypatch.setattr(PagedAttention, "in_place", counted)
    eng = LLMEngine(model, batch_invariant=True, quantize=False, dtype=str(dtype).split(".")[1],
                    block_size=128 if name == "tiny-v4" else 16, num_blocks=12 if name == "tiny-v4" else 40, max_num_seqs=4, max_num_batched_tokens=19)
    rows = spy_logits(eng)
    # 140: the HCA layer of tiny-v4 gets an entry
    done = greedy_random_run(eng, model.cfg.vocab_size, (37, 5, 23, 140), seed=4, max_tokens=12)
    return done, rows, calls[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41"])
def test_engine_logits_are_bitwise_the_gather_paths(name: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    ref_tokens, ref_rows, ref_calls = _serve(name, dtype, False, monkeypatch)
    tokens, rows, calls = _serve(name, dtype, True, monkeypatch)
    assert ref_calls == 0 and calls >= 6 * 12  # every layer of every step took the in-place path
    assert tokens == ref_tokens
    assert rows.keys() == ref_rows.keys()
    for k in rows:
        assert torch.equal(rows[k], ref_rows[k]), k


def _topk_config(name: str, k: int):
    import json

    from kvshare.config import ModelConfig
    from kvshare.shipped import resolve_config_path

    raw = json.loads(resolve_config_path(name).read_text())
    raw.update(index_topk=k)
    return ModelConfig.from_dict(raw)


def _generate(model: Transformer, prompts: list[list[int]], n: int, **kw):
    eng = LLMEngine(model, batch_invariant=True, quantize=False, dtype="bfloat16", max_num_seqs=4,
                    max_num_batched_tokens=23, **kw)
    rows = spy_logits(eng)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    with torch.inference_mode():
        while eng.has_unfinished_requests():
            eng.step()
    return rows


@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41"])
def test_a_selection_that_fits_in_the_top_k_skips_the_scores_with_the_same_logits(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """While no sequence has more than k compressed rows the indexer returns every causal entry
    unscored (`Indexer.every_entry_fits`); the widest sequence crosses k during decode, so
    both the unscored and the scored selections run. Every sampled logits row equals, bitwise, the
    run that scores every step. Mutation caught (both tests fail): the unscored picks without each
    row's causal bound (every row given the entries below the widest sequence's count)."""
    from kvshare.model.indexer import Indexer

    v4 = name == "tiny-v4"
    # tiny-v41's candidate pool holds 5 entries, so k = 5 there (its ratio-2 index sources cross it)
    model = Transformer(_topk_config(name, 10 if v4 else 5), quant=False).init_weights(5).eval().to(torch.bfloat16)
    rng = random.Random(2)
    prompts = [[rng.randrange(model.cfg.vocab_size - 1) for _ in range(n)] for n in ((25, 7, 30) if v4 else (6, 3, 9))]
    kw = dict(block_size=128, num_blocks=8) if name == "tiny-v4" else dict(block_size=16, num_blocks=24)
    real = Indexer.every_entry_fits
    seen = []

    def fits(self, width):
        seen.append(real(self, width))
        return seen[-1]

    monkeypatch.setattr(Indexer, "every_entry_fits", fits)
    got = _generate(model, prompts, 16, **kw)
    assert True in seen and False in seen
    monkeypatch.setattr(Indexer, "every_entry_fits", lambda self, width: False)
    want = _generate(model, prompts, 16, **kw)
    assert got.keys() == want.keys()
    for key in got:
        assert torch.equal(got[key], want[key]), key


# observed max |diff| over these runs: fp32 native vs row-invariant torch 4.8e-7 (tiny-v4) / 7.2e-7
# (tiny-v41), batched torch vs row-invariant torch 6.0e-7 / 4.8e-7; bf16 2.0e-3 / 9.8e-4 and
# 2.0e-3 / 0 (one bf16 rounding of outputs below 1)
_TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41"])
def test_paged_attention_implementations_agree(name: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """`PagedAttention`'s three implementations on the same inputs of every layer of every step of a
    paged, batch-invariant engine (chunked prefill, batched decode; the bound one is the native):
    the native (in place where the backend offers it), the row-invariant torch and the batched
    torch agree within the summation-order error stated above. Mutation caught (all four): the
    gathered rows' mask dropping entry 0 (``picks > 0`` in `PagedAttention._picked`)."""
    model = Transformer(load_config(name), quant=False).init_weights(3).eval().to(dtype)
    worst = {"native": 0.0, "torch": 0.0}
    real = PagedAttention.forward_native

    def all_three(self, q, kv, picks, ctx, sink):
        got = real(self, q, kv, picks, ctx, sink)
        ref = self.forward_invariant(q, kv, picks, ctx, sink)
        batched = self.forward_torch(q, kv, picks, ctx, sink)
        worst["native"] = max(worst["native"], (got.float() - ref.float()).abs().max().item())
        worst["torch"] = max(worst["torch"], (batched.float() - ref.float()).abs().max().item())
        return got

    monkeypatch.setattr(PagedAttention, "forward_native", all_three)
    eng = LLMEngine(model, batch_invariant=True, quantize=False, dtype=str(dtype).split(".")[1],
                    block_size=128 if name == "tiny-v4" else 16, num_blocks=12 if name == "tiny-v4" else 40,
                    max_num_seqs=4, max_num_batched_tokens=19)
    assert model.layers[0].attn.attend.impl.__name__ == "all_three"
    greedy_random_run(eng, model.cfg.vocab_size, (37, 5, 23, 140), seed=4, max_tokens=8)
    assert 0 < max(worst.values()) and all(v < _TOL[dtype] for v in worst.values()), worst
