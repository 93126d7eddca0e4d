"""Engram in the model (tiny-v41-engram: Engram before layers 1 and 4; layer 4 is a kv source).

* Engram's output equals the spec's formulas written out here (e4m3 bytes decoded by hand, row
  scales 2^(byte-127), projection, per-stream gate, shared value);
* the model applies it at the start of block L with layer L-1's lagged `pre` (forward rebuilt by
  hand around the blocks);
* one-shot prefill = token-by-token decode = random chunks, batched = alone (quantisation off and
  on, float64, and fp32 with quantisation off);
* the feature is live: removing Engram's value changes the logits, and equals removing Engram;
* training reaches `wkv`, `q_weight` and `k_weight`; the FP8 table stays frozen.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvshare.config import load_config
from kvshare.layers import KernelChoice
from kvshare.cache.dense import DenseCache
from kvshare.model import Transformer
from kvshare.step.context import StepContext
from kvshare.layers.mhc_torch import hc_collapse, identity_pre
from kvshare.step import StepBatch, StepState
from test_model_common import assert_close, random_chunks, token_ids

NAME = "tiny-v41-engram"
SEQ = 24
MAX_LEN = 64


def make(quant: bool, dtype: torch.dtype = torch.float64, seed: int = 0) -> Transformer:
    return Transformer(load_config(NAME), quant=quant).init_weights(seed).eval().to(dtype)


def run(model: Transformer, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Logits of every token of one sequence fed in `chunks`, each chunk with its previous 3 ids."""
    cache = DenseCache(model.cfg, model.topo, 1, MAX_LEN, dtype=model.embed.weight.dtype)
    out, s = [], 0
    with torch.no_grad():
        for n in chunks:
            batch = StepBatch.build([s], [n], prev_tokens=[ids[max(0, s - 3):s].tolist()])
            out.append(model(ids[s:s + n], batch, cache))
            s += n
    return torch.cat(out)


def e4m3_by_hand(b: np.ndarray) -> np.ndarray:
    """OCP e4m3fn decoding: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal."""
    b = b.astype(np.int64)
    sign = np.where(b >> 7, -1.0, 1.0)
    e, m = (b >> 3) & 15, b & 7
    mag = np.where(e == 0, m / 8.0 * 2.0**-6, (1 + m / 8.0) * 2.0 ** (e - 7))
    return sign * mag


def engram_by_hand(h: np.ndarray, rows: np.ndarray, codes: np.ndarray, scales: np.ndarray, wkv: np.ndarray,
                   q: np.ndarray, k: np.ndarray, eps: float) -> np.ndarray:
    """spec/engram_dspark.md §1.7-§1.8 in float64 numpy, one token and one stream at a time."""
    t, hc, d = h.shape
    out = np.empty_like(h)
    for i in range(t):
        emb = []
        for r in rows[i]:
            vals = e4m3_by_hand(codes[r]).reshape(-1, 32) * (2.0 ** (scales[r].astype(np.int64) - 127))[:, None]
            emb.append(vals.reshape(-1))
        kv = wkv @ np.concatenate(emb)
        value = kv[hc * d:]
        for j in range(hc):
            x, key = h[i, j], kv[j * d:(j + 1) * d]
            rstd = 1 / math.sqrt((x**2).mean() + eps) / math.sqrt((key**2).mean() + eps)
            dot = float((x * q[j] * k[j] * key).sum()) * rstd / math.sqrt(d)
            gate = 1 / (1 + math.exp(-math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot)))
            out[i, j] = x + gate * value
    return out


@pytest.mark.parametrize("quant", [False, True], ids=["plain", "quant"])
def test_engram_module_matches_hand_formulas(quant: bool) -> None:
    model = make(quant)
    eng = model.layers[4].engram
    g = torch.Generator().manual_seed(3)
    h = torch.randn(5, 4, model.cfg.hidden_size, generator=g, dtype=torch.float64)
    rows = torch.randint(0, eng.table.rows, (5, eng.wkv.in_features // 64), generator=g)
    with torch.no_grad():
        got = eng(h, rows).numpy()
    want = engram_by_hand(h.numpy(), rows.numpy(), eng.table.codes, eng.table.scales, eng.wkv.weight.detach().numpy(),
                          eng.q_weight.detach().numpy(), eng.k_weight.detach().numpy(), model.cfg.rms_norm_eps)
    # float64 both ways; observed 3.3e-16. With quant on the wkv input act-quant is exact on
    # table rows (already e4m3 x 2^k per 32 columns), so the hand formula has no quantiser.
    assert np.abs(got - want).max() < 1e-12
    assert np.abs(got - h.numpy()).max() > 0.1  # the add is not a no-op


def test_forward_applies_engram_before_block_mixes_with_lagged_pre() -> None:
    model = make(quant=True)
    ids = token_ids(model.cfg, 13, seed=4)
    t = ids.numel()
    batch = StepBatch.build([0], [t])
    with torch.no_grad():
        want = model(ids, batch, DenseCache(model.cfg, model.topo, 1, MAX_LEN, dtype=torch.float64))
        # Rebuild the forward: hash rows from a hand-made look-back, Engram by hand, blocks without Engram.
        pos = torch.arange(t)
        src = (pos.unsqueeze(1) - torch.arange(4)).clamp_min(0)
        rows = model.engram_hash(ids[src], pos.unsqueeze(1) - torch.arange(4) >= 0)
        cache = DenseCache(model.cfg, model.topo, 1, MAX_LEN, dtype=torch.float64)
        ctx = StepContext(batch, cache, StepState(), ids, model.rope_main, model.rope_compress)
        h = model.embed(ids).unsqueeze(1).expand(-1, 4, -1).contiguous()
        pre = identity_pre(t, 4, h.device)
        for block in model.layers:
            eng = block.engram
            if eng is not None:
                h = torch.from_numpy(engram_by_hand(
                    h.numpy(), rows[:, eng.index].numpy(), eng.table.codes, eng.table.scales,
                    eng.wkv.weight.numpy(), eng.q_weight.numpy(), eng.k_weight.numpy(), model.cfg.rms_norm_eps))
                block.engram = None
            try:
                h, pre = block(h, pre, ctx)  # `pre` of layer L-1's FFN, computed before Engram
            finally:
                block.engram = eng
        got = model.head(model.norm(hc_collapse(h, pre))).float()  # the model returns fp32 logits
    assert (got - want).abs().max().item() < 1e-6  # float64 cast to fp32; observed 0


@pytest.mark.parametrize("quant,dtype,tol", [
    (False, torch.float32, 1e-5),  # fp32, observed 3.6e-6
    (False, torch.float64, 1e-6),  # logits come back fp32 (1 ulp ~ 5e-7); observed 0
    (True, torch.float64, 1e-6),  # observed 0
], ids=["plain-fp32", "plain-fp64", "quant-fp64"])
def test_prefill_decode_chunks_agree(quant: bool, dtype: torch.dtype, tol: float) -> None:
    model = make(quant, dtype)
    ids = token_ids(model.cfg, SEQ, seed=7)
    full = run(model, ids, [SEQ])
    assert_close(run(model, ids, [1] * SEQ), full, atol=tol, what="decode vs prefill")
    for seed in range(3):
        chunks = random_chunks(SEQ, seed=seed, most=6)
        assert_close(run(model, ids, chunks), full, atol=tol, what=f"chunks {chunks} vs prefill")


@pytest.mark.parametrize("quant", [False, True], ids=["plain", "quant"])
def test_batched_equals_alone(quant: bool) -> None:
    model = make(quant)
    a, b = token_ids(model.cfg, 20, seed=11), token_ids(model.cfg, 11, seed=12)
    alone_a, alone_b = run(model, a, [20]), run(model, b, [11])
    cache = DenseCache(model.cfg, model.topo, 3, MAX_LEN, dtype=torch.float64)
    got_a, got_b = [], []
    with torch.no_grad():
        for (sa, na), (sb, nb) in [((0, 6), (0, 2)), ((6, 1), (2, 5)), ((7, 9), (7, 1)), ((16, 4), (8, 3))]:
            batch = StepBatch.build([sb, sa], [nb, na], [0, 2],
                                    prev_tokens=[b[max(0, sb - 3):sb].tolist(), a[max(0, sa - 3):sa].tolist()])
            out = model(torch.cat([b[sb:sb + nb], a[sa:sa + na]]), batch, cache)
            got_b.append(out[:nb])
            got_a.append(out[nb:])
    assert_close(torch.cat(got_a), alone_a, atol=1e-6, what="a batched vs alone")  # fp32 logits; observed 0
    assert_close(torch.cat(got_b), alone_b, atol=1e-6, what="b batched vs alone")


def test_zero_gate_value_changes_logits_and_equals_no_engram() -> None:
    model = make(quant=False)
    ids = token_ids(model.cfg, 16, seed=9)
    live = run(model, ids, [16])
    d, hc = model.cfg.hidden_size, model.cfg.hc_mult
    with torch.no_grad():
        for lid in model.cfg.engram_layer_ids:
            model.layers[lid].engram.wkv.weight[hc * d:] = 0  # gate * value == 0 for every stream
    zeroed = run(model, ids, [16])
    engines = {lid: model.layers[lid].engram for lid in model.cfg.engram_layer_ids}
    for lid in engines:
        model.layers[lid].engram = None
    model.engram_hash, lookback = None, model.engram_lookback
    without = run(model, ids, [16])
    assert torch.equal(zeroed, without)
    assert (live - zeroed).abs().max().item() > 0.1  # observed 3.3: the feature is live
    assert lookback == 3


def test_training_reaches_engram_parameters() -> None:
    from kvshare.train.loop import lm_loss

    model = Transformer(load_config(NAME), quant=True).init_weights(0).train()
    model.bind(KernelChoice.reference())  # training: the autograd-capable torch reference
    before = model.layers[1].engram.table.codes.copy()
    loss = lm_loss(model, [token_ids(model.cfg, 12, seed=1), token_ids(model.cfg, 9, seed=2)])
    loss.backward()
    for lid in model.cfg.engram_layer_ids:
        eng = model.layers[lid].engram
        for p in (eng.wkv.weight, eng.q_weight, eng.k_weight):
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().max() > 0
    assert np.array_equal(model.layers[1].engram.table.codes, before)


def test_table_lookup_decodes_every_code_byte() -> None:
    """Every e4m3 byte (NaN codes 0x7f / 0xff excluded) and a spread of e8m0 scale bytes, by hand."""
    from kvshare.model.engram_table import EngramTable

    codes = np.array([0 if b & 0x7F == 0x7F else b for b in range(256)], dtype=np.uint8).reshape(4, 64)
    scales = np.array([[100, 127], [131, 150], [127, 90], [140, 127]], dtype=np.uint8)
    table = EngramTable(codes, scales, "memory")
    rows = torch.tensor([[3, 0], [1, 2]])
    got = table.lookup(rows, torch.float64).numpy()
    for i, r in enumerate(rows.flatten().tolist()):
        want = (e4m3_by_hand(codes[r]).reshape(2, 32) * 2.0 ** (scales[r].astype(np.int64) - 127)[:, None])
        assert np.array_equal(got.reshape(4, 64)[i], want.reshape(-1))
