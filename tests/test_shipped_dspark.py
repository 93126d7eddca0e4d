"""The shipped kvshare-mini-v41's trained DSpark drafter (issue 17 item 4) and its training step.

* the release loads with ``draft=True`` and its backbone tensors are the previous release's, bit
  for bit (hash of main's model.safetensors before the drafter was added);
* greedy output with speculation equals greedy output without it (lossless whatever the drafter);
* the drafter's acceptance on a fixed prompt is at least the measured value (a floor, not a hope);
  both in float64, where greedy tokens do not depend on the CPU or on the verify step's extra rows
  (in bf16 they do until the engine is batch-invariant, issue 24: on an AMX Xeon bf16 speculative and
  plain greedy parted at token 16 and the acceptance was 3.65 against 3.917 where it was trained);
* one distillation step trains only ``mtp.*`` and lowers the loss on its batch.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from kvshare.engine.sampling import SamplingParams
from kvshare.shipped import shipped_model_dir

MODEL = "kvshare-mini-v41"
SPEC = {"method": "dspark"}
PROMPT = "def "
NEW = 96
# sha256 over (name, dtype, shape, bytes) of every tensor of the release before the drafter
# (main at c0849b4, model.safetensors sha256 d2f24745...): the backbone must not move.
BACKBONE_SHA256 = "ac0a3a1452d1c0ab14003c4b09a58c7dbcf205f169d95ebfda9d002fba2fe04a"
# Measured in float64: 3.276 (66 of 113 drafts accepted in 29 verifies, K = 4) for PROMPT, NEW tokens,
# 1 thread, the same natively (AVX-512/AMX) and under ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2.
# (Issue 17's 3.917 was a bf16 run on another CPU; bf16 acceptance moves with the CPU's rounding.)
ACCEPT_FLOOR = 3.27

needs_weights = pytest.mark.skipif(shipped_model_dir(MODEL) is None, reason="no shipped weights")


def backbone_sha256(path: str) -> str:
    from safetensors import safe_open

    h = hashlib.sha256()
    with safe_open(path, "pt") as f:
        for k in sorted(k for k in f.keys() if not k.startswith("mtp.")):
            t = f.get_tensor(k)
            h.update(k.encode())
            h.update(str(t.dtype).encode())
            h.update(str(tuple(t.shape)).encode())
            h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@needs_weights
def test_shipped_backbone_is_unchanged_and_drafter_loads():
    from kvshare.weights.loader import load_model

    d = shipped_model_dir(MODEL)
    assert backbone_sha256(str(d / "model.safetensors")) == BACKBONE_SHA256
    m = load_model(MODEL, draft=True)
    cfg = m.cfg
    assert cfg.num_draft_layers == len(m.mtp) >= 1 and cfg.dspark_block_size >= 2
    assert all(float(p.detach().abs().sum()) > 0 for n, p in m.mtp.named_parameters() if "markov_head.head" in n)


def _generate(spec: dict | None) -> tuple[list[int], dict]:
    from kvshare.engine.engine import LLMEngine
    from kvshare.tokenizer import ByteTokenizer

    eng = LLMEngine(MODEL, speculative_config=spec, max_num_seqs=1, max_model_len=256, dtype="float64")
    eng.add_request("r", ByteTokenizer(259).encode(PROMPT, add_bos=True),
                    SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    toks: list[int] = []
    with torch.inference_mode():
        while eng.has_unfinished_requests():
            for o in eng.step():
                toks = list(o.token_ids)
    return toks, dict(eng.stats().extra)


@pytest.fixture(scope="module")
def runs():
    return _generate(None), _generate(SPEC)


@needs_weights
def test_speculative_greedy_equals_plain_greedy(runs):
    (plain, _), (spec, st) = runs
    assert len(plain) == NEW and spec == plain
    assert st["spec_num_verifies"] > 0  # it did speculate


@needs_weights
def test_shipped_drafter_acceptance_floor(runs):
    _, (_, st) = runs
    # Deterministic (greedy, float64): see ACCEPT_FLOOR's comment for the measured value.
    assert st["spec_mean_accepted_length"] >= ACCEPT_FLOOR


@needs_weights
def test_distillation_step_trains_only_the_stages():
    from kvshare.train.dspark import DSparkTrainConfig, build, step_loss
    from kvshare.train.data import load_split, sample_contexts

    torch.manual_seed(0)
    tc = DSparkTrainConfig(base=MODEL, batch=2, ctx=48, lr=1e-3)
    model, cfg = build(tc)
    assert cfg.num_draft_layers == tc.stages and cfg.dspark_block_size == tc.block_size
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ctx = sample_contexts(load_split(heldout=False), tc.batch, tc.ctx, torch.Generator().manual_seed(3))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tc.lr, weight_decay=0.0)
    losses = []
    for _ in range(3):
        loss, stats = step_loss(model, ctx, tc)
        losses.append(float(loss.detach()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < losses[0], losses
    assert len(stats["row_acc"]) == tc.block_size
    moved = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert all(n.startswith("mtp.") for n in moved), sorted(moved)  # the target is frozen
    assert {"mtp.0.main_proj.weight", "mtp.0.markov_head.head.weight", "mtp.0.attn.wkv.weight"} <= moved


def test_draft_targets_match_a_hand_written_walk():
    from kvshare.train.dspark import draft_targets

    g_ = torch.Generator().manual_seed(5)
    x = torch.randint(0, 3, (2, 11), generator=g_)  # a 3-letter alphabet: the chain often agrees
    g = torch.randint(0, 3, (2, 11), generator=g_)
    b = 3
    seq, anc, label, prev, ok = draft_targets(x, g, b)
    rows = []
    for s in range(2):
        for a in range(1, 11 - b + 1):
            lab = [int(g[s, a + j]) for j in range(b)]
            prv = [int(x[s, a])] + lab[:-1]
            good, chain = [], True
            for j in range(b):
                good.append(chain)
                chain = chain and int(x[s, a + 1 + j]) == lab[j] if j < b - 1 else chain
            rows.append((s, a, lab, prv, good))
    assert [(int(s), int(a), lb.tolist(), p.tolist(), o.tolist())
            for s, a, lb, p, o in zip(seq, anc, label, prev, ok)] == rows
    assert 0 < int(ok[:, 1:].sum()) < ok[:, 1:].numel()  # both cases occur


@needs_weights
def test_recipe_defaults_are_the_shipped_drafter_run():
    """The recipe's stage 3 (DSparkTrainConfig defaults, no time cap) is the run that shipped."""
    import json
    from dataclasses import asdict

    from kvshare.train.dspark import DSparkTrainConfig

    log = json.loads((shipped_model_dir(MODEL) / "dspark_log.json").read_text())
    shipped = {k: v for k, v in log["config"].items() if k not in ("base", "minutes")}
    want = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(DSparkTrainConfig()).items()
            if k not in ("base", "minutes")}
    assert shipped == want
    assert log["final"]["step"] == DSparkTrainConfig().steps and not log["final"]["stopped_early"]
