"""The DSpark draft model against the spec: hand-written block forward, taps, non-causal block,
loader, and draft windows that hold exactly the committed context after speculative steps."""

from __future__ import annotations

import random

import pytest
import torch

from kvshare.config import load_config
from kvshare.engine.engine import LLMEngine
from kvshare.engine.sampling import SamplingParams
from kvshare.errors import CheckpointError
from kvshare.model.deepseek import Transformer
from kvshare.cache.dense import DenseCache
from kvshare.model.dspark import DSparkDraft, attach_dspark
from kvshare.weights.loader import load_model
from kvshare.weights.checkpoint_write import save_checkpoint
from kvshare.step import StepBatch, StepState

import dspark_reference as ref
from test_speculative_exact import greedy_reference, oracle

CFG = "tiny-v41-dspark"


def model(quant: bool = False, seed: int = 3) -> Transformer:
    m = Transformer(load_config(CFG), quant=quant)
    attach_dspark(m)
    return m.init_weights(seed).double().eval()


@torch.inference_mode()
def dense_prefill(m: Transformer, toks: list[int]):
    """(DSparkDraft, DenseCache with the draft windows written, StepState taps, hook-captured taps)."""
    cfg = m.cfg
    cache = DenseCache(cfg, m.topo, 1, len(toks) + 8, dtype=torch.float64)
    hooked: dict[int, torch.Tensor] = {}
    handles = [m.layers[t].register_forward_pre_hook(lambda mod, args, t=t: hooked.__setitem__(t, args[0].mean(1)))
               for t in cfg.dspark_target_layer_ids]
    state = StepState(taps={t: None for t in cfg.dspark_target_layer_ids})
    batch = StepBatch.build([0], [len(toks)], [0])
    try:
        m(torch.tensor(toks), batch, cache, state)
    finally:
        for h in handles:
            h.remove()
    d = DSparkDraft(m)
    w = d.windows(cache)
    d.write_context(w, d.main_x(state.taps), batch.slots[batch.seq_index], batch.positions)
    return d, w, state.taps, hooked


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(255) for _ in range(n)]


def test_taps_are_the_mean_stream_entering_each_target_layer():
    m = model()
    _, _, taps, hooked = dense_prefill(m, prompt(11))
    assert list(taps) == list(m.cfg.dspark_target_layer_ids)
    for t in taps:
        assert torch.equal(taps[t], hooked[t])
    assert not torch.allclose(taps[3], taps[4])


@pytest.mark.parametrize("n", [3, 13])
def test_draft_block_matches_hand_written_formulas(n):
    """n = 13 > W = 8: the context is the last 8 committed positions; n = 3: all of them."""
    m = model()
    toks = prompt(n, seed=n)
    d, w, _, hooked = dense_prefill(m, toks)
    anchor = 17
    with torch.inference_mode():
        u, x_head = d.block_forward(w, torch.tensor([anchor]), torch.tensor([n]), torch.tensor([0]))
    W = {k: v.double() for k, v in m.state_dict().items()}
    taps = torch.stack([hooked[t] for t in m.cfg.dspark_target_layer_ids], 1)
    u_ref, x_ref = ref.draft_block(W, m.cfg, taps, anchor, n)
    # Observed max |diff|: U 2.4e-15, x_head 1.8e-14 (float64, quant off).
    assert (u[0] - u_ref).abs().max().item() < 1e-12
    assert (x_head[0] - x_ref).abs().max().item() < 1e-12
    got, prev, conf = [], torch.tensor([anchor]), []
    with torch.inference_mode():
        for i in range(u.shape[1]):
            bias, emb = d.markov_bias(prev)
            conf.append(float(d.confidence(x_head[:, i], emb)))
            prev = (u[:, i] + bias).argmax(-1)
            got.append(int(prev))
    assert got == ref.markov_greedy(W, m.cfg, u_ref, anchor)
    conf_ref = ref.confidence(W, m.cfg, x_ref, torch.tensor([anchor] + got[:-1]))
    assert (torch.tensor(conf, dtype=torch.float64) - conf_ref).abs().max().item() < 1e-12


def test_block_is_non_causal_and_uses_main_rope():
    """Changing what block positions 1..B-1 hold (the noise embedding) changes row 0's logits."""
    m = model()
    d, w, _, _ = dense_prefill(m, prompt(9))
    args = (w, torch.tensor([5]), torch.tensor([9]), torch.tensor([0]))
    with torch.inference_mode():
        u0, _ = d.block_forward(*args)
        m.embed.weight[m.cfg.dspark_noise_token_id] += 0.5
        u1, _ = d.block_forward(*args)
    assert (u1[0, 0] - u0[0, 0]).abs().max().item() > 1e-3
    assert all(st.attn.rope is m.rope_main for st in d.stages)
    i = torch.arange(m.cfg.qk_rope_head_dim // 2, dtype=torch.float64)
    assert torch.equal(m.rope_main.freqs64, 10000.0 ** (-2.0 * i / m.cfg.qk_rope_head_dim))  # theta 1e4, no YaRN


def test_draft_windows_hold_the_committed_context_after_speculation():
    """After verify steps with partial acceptance (quant on, float64), a draft block from the engine's
    windows equals the block computed from a fresh prefill of the committed tokens."""
    m = model(quant=True, seed=1)
    eng = LLMEngine(m, speculative_config={"method": "dspark", "num_speculative_tokens": 5},
                    block_size=8, num_blocks=30, max_num_batched_tokens=6)
    p = prompt(10, seed=4)
    # Drafts right for 2 tokens then wrong: every verify commits anchor + 2 drafts, rejects 3.
    eng.speculator.draft_override = oracle([greedy_reference(m, p, 48)], [p], 2, m.cfg.vocab_size)
    eng.add_request("r", p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    seq = eng.requests["r"]
    checked = 0
    for _ in range(8):
        eng.step()
        if seq.num_computed < len(p):
            continue
        a = seq.num_computed
        args = (torch.tensor([seq.output_token_ids[-1]]), torch.tensor([a]))
        with torch.inference_mode():
            u, _ = eng.speculator.draft.block_forward(eng.speculator.windows, *args, torch.tensor([seq.slot]))
            d, w, _, _ = dense_prefill(m, seq.tokens[:a])
            u_ref, _ = d.block_forward(w, *args, torch.tensor([0]))
        assert (u - u_ref).abs().max().item() < 1e-12  # observed 0 (the same rows, the same ops)
        checked += 1
    st = eng.stats().extra
    assert checked >= 4 and st["spec_draft_tokens"] > st["spec_accepted_tokens"] > 0


def test_loader_round_trip_and_released_names(tmp_path):
    m = model()
    cfg = m.cfg
    names = [k for k in m.state_dict() if k.startswith("mtp.")]
    last = cfg.num_draft_layers - 1
    assert [k for k in names if "main_" in k] == ["mtp.0.main_proj.weight", "mtp.0.main_norm.weight"]
    heads = {k for k in names if any(s in k for s in ("markov", "confidence", ".norm."))}
    assert heads == {f"mtp.{last}.norm.weight", f"mtp.{last}.markov_head.embed.weight",
                     f"mtp.{last}.markov_head.head.weight", f"mtp.{last}.confidence_head.proj.weight"}
    assert m.state_dict()[f"mtp.{last}.confidence_head.proj.weight"].shape == (1, cfg.hidden_size + 16)
    assert not any(k.endswith(("embed.weight", "head.weight")) and "markov" not in k for k in names)
    assert sum(1 for k in names if k.startswith("mtp.0.ffn.experts.") and k.endswith("w1.weight")) == 4
    sd = {k: v.float() for k, v in m.state_dict().items()}
    sd["mtp.0.ffn.gate.bias_vl"] = torch.zeros(4)  # accepted, unused (drafts are text)
    save_checkpoint(sd, cfg, tmp_path)
    back = load_model(tmp_path, quant=False, draft=True)
    for k, v in back.state_dict().items():
        assert torch.equal(v, sd[k]), k
    plain = load_model(tmp_path, quant=False)  # without speculation the mtp tensors are skipped
    assert not hasattr(plain, "mtp")
    del sd["mtp.1.markov_head.head.weight"]
    save_checkpoint(sd, cfg, tmp_path / "broken")
    with pytest.raises(CheckpointError, match="mtp.1.markov_head.head.weight"):
        load_model(tmp_path / "broken", draft=True)


def test_release_shaped_mtp_names_on_meta_device():
    """V4.1-Flash dims (spec §2.9, dequantised shapes); the backbone's experts cut to 8 for speed."""
    import dataclasses

    from kvshare.model.dspark import dspark_shapes

    cfg = dataclasses.replace(load_config("deepseek-v4.1-flash"), engram_layer_ids=(), n_routed_experts=8)
    with torch.device("meta"):
        m = Transformer(cfg)
        attach_dspark(m)
    shapes = dspark_shapes(m)
    want = {
        "mtp.0.hc_attn_fn": (24, 20480), "mtp.1.hc_ffn_base": (24,), "mtp.2.hc_attn_scale": (3,),
        "mtp.0.attn_norm.weight": (5120,), "mtp.1.attn.attn_sink": (64,), "mtp.2.attn.wq_a.weight": (1280, 5120),
        "mtp.0.attn.q_norm.weight": (1280,), "mtp.0.attn.wq_b.weight": (32768, 1280),
        "mtp.0.attn.wkv.weight": (512, 5120), "mtp.0.attn.kv_norm.weight": (512,),
        "mtp.0.attn.wo_a.weight": (8192, 4096), "mtp.0.attn.wo_b.weight": (5120, 8192),
        "mtp.1.ffn.gate.weight": (128, 5120), "mtp.1.ffn.gate.bias": (128,),
        "mtp.0.ffn.shared_experts.w1.weight": (2304, 5120), "mtp.0.ffn.shared_experts.w2.weight": (5120, 2304),
        "mtp.2.ffn.experts.127.w1.weight": (2304, 5120), "mtp.2.ffn.experts.127.w2.weight": (5120, 2304),
        "mtp.0.main_proj.weight": (5120, 15360), "mtp.0.main_norm.weight": (5120,),
        "mtp.2.norm.weight": (5120,), "mtp.2.markov_head.embed.weight": (129280, 256),
        "mtp.2.markov_head.head.weight": (129280, 256), "mtp.2.confidence_head.proj.weight": (1, 5376),
    }
    for k, v in want.items():
        assert shapes[k] == v, k
    assert "mtp.2.ffn.experts.128.w1.weight" not in shapes and "mtp.1.main_proj.weight" not in shapes
    assert not any(k.startswith(("mtp.0.norm", "mtp.1.markov", "mtp.0.confidence")) for k in shapes)
    # Per stage: 6 hc + 2 norms + 8 attention + 2 gate + 3 shared + 128 * 3 experts = 405 tensors,
    # plus main_proj / main_norm and the last stage's 4. The release adds a scale per FP8 linear
    # (5 attention + 3 shared per stage, main_proj) and FP4 expert (384 per stage) and bias_vl per gate:
    # the spec's 2,401 tensors.
    assert len(shapes) == 3 * 405 + 2 + 4
    assert len(shapes) + 3 * (8 + 384 + 1) + 1 == 2401


def test_tap_on_an_engram_layer_is_taken_after_its_engram():
    """tiny-v41-engram-dspark: target 4 is an Engram layer; the tap is the mean of the stream after
    layer 4's Engram has been added (REF41 and SGLang; spec §4 Q1), not the stream entering block 4."""
    m = Transformer(load_config("tiny-v41-engram-dspark"), quant=False)
    attach_dspark(m)
    m = m.init_weights(3).double().eval()
    cfg = m.cfg
    out: dict[str, torch.Tensor] = {}
    h1 = m.layers[4].register_forward_pre_hook(lambda mod, args: out.__setitem__("block_in", args[0].mean(1)))
    h2 = m.layers[4].engram.register_forward_hook(lambda mod, args, res: out.__setitem__("engram_out", res.mean(1)))
    toks = prompt(9, seed=2)
    state = StepState(taps={t: None for t in cfg.dspark_target_layer_ids})
    try:
        with torch.inference_mode():
            m(torch.tensor(toks), StepBatch.build([0], [len(toks)], [0]), DenseCache(cfg, m.topo, 1, 16,
                                                                                 dtype=torch.float64), state)
    finally:
        h1.remove()
        h2.remove()
    assert torch.equal(state.taps[4], out["engram_out"])
    assert (state.taps[4] - out["block_in"]).abs().max().item() > 1e-3  # the Engram contribution is live
