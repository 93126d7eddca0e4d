"""Training and evaluation: corpus manifest, the training loss path, dense vs engine bits per byte."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kvshare.config import load_config
from kvshare.layers import KernelChoice
from kvshare.model.deepseek import Transformer
from kvshare.shipped import resolve_config_path
from kvshare.train.baselines import ByteNgram
from kvshare.train.data import (
    BOS,
    build_manifest,
    eval_chunks,
    is_heldout,
    load_split,
    sample_contexts,
    verify_manifest,
)
from kvshare.train.loop import dense_cache_factory, lm_loss, lr_at, param_groups, train_losses



def _tiny_byte_model(seed: int = 0) -> Transformer:
    """tiny-v41 with the byte vocabulary (bytes + bos/eos/pad), randomly initialised."""
    raw = json.loads(resolve_config_path("tiny-v41").read_text())
    raw.update(vocab_size=259, bos_token_id=256, eos_token_id=257, pad_token_id=258)
    torch.manual_seed(seed)
    model = Transformer(load_config(raw), quant=True).init_weights(seed).float()
    model.bind(KernelChoice.reference())  # training: the autograd-capable torch reference
    return model


def _fake_stdlib(root: Path) -> None:
    (root / "pkg").mkdir(parents=True)
    (root / "test").mkdir()
    (root / "a.py").write_bytes(b"import os\n" * 40)
    (root / "pkg" / "b.py").write_bytes(b"def f(x):\n    return x + 1\n" * 30)
    (root / "test" / "test_a.py").write_bytes(b"assert True\n")


def test_manifest_lists_sorted_non_test_files_and_detects_changes(tmp_path: Path) -> None:
    _fake_stdlib(tmp_path)
    m = build_manifest(tmp_path)
    assert [e["path"] for e in m["files"]] == ["a.py", "pkg/b.py"]
    assert m["aggregate_sha256"] == build_manifest(tmp_path)["aggregate_sha256"]
    assert verify_manifest(m, tmp_path) == []
    (tmp_path / "a.py").write_bytes(b"import sys\n")
    with pytest.warns(UserWarning, match="differs from the manifest"):
        problems = verify_manifest(m, tmp_path)
    assert problems == ["content differs: a.py"]


def test_split_is_a_function_of_the_path_and_streams_start_with_bos(tmp_path: Path) -> None:
    _fake_stdlib(tmp_path)
    assert is_heldout("json/decoder.py") == is_heldout("json/decoder.py")
    both = load_split(False, tmp_path).paths + load_split(True, tmp_path).paths
    assert sorted(both) == ["a.py", "pkg/b.py"]
    split = load_split(False, tmp_path, paths=["a.py", "pkg/b.py"]) if not is_heldout("a.py") else \
        load_split(True, tmp_path, paths=["a.py", "pkg/b.py"])
    assert int(split.tokens[0]) == BOS
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    c1, c2 = sample_contexts(split, 3, 20, g1), sample_contexts(split, 3, 20, g2)
    assert torch.equal(c1, c2) and c1.shape == (3, 20) and bool((c1[:, 0] == BOS).all())
    pieces = eval_chunks(split, 64)
    assert all(0 < p.numel() <= 64 for p in pieces) and sum(p.numel() for p in pieces) == split.num_bytes


def test_cosine_schedule_warms_up_then_decays_to_the_floor() -> None:
    assert lr_at(0, 100, 1.0, 10, 0.1) == pytest.approx(0.1)
    assert lr_at(9, 100, 1.0, 10, 0.1) == pytest.approx(1.0)
    assert lr_at(100, 100, 1.0, 10, 0.1) == pytest.approx(0.1)
    assert lr_at(40, 100, 1.0, 10, 0.1) > lr_at(60, 100, 1.0, 10, 0.1)


def test_loss_with_grad_matches_no_grad_and_reaches_the_compressor() -> None:
    model = _tiny_byte_model()
    ctx = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in (40, 33)]
    with torch.no_grad():
        ref = lm_loss(model, ctx, dense_cache_factory)
    loss = lm_loss(model, ctx, dense_cache_factory)
    assert float(loss.detach()) == pytest.approx(float(ref), abs=1e-5)
    loss.backward()
    comp = [p for n, p in model.named_parameters() if ".compressor." in n and n.endswith("wkv.weight")]
    assert comp and all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in comp)


def test_indexer_distillation_trains_every_indexer_projection() -> None:
    model = _tiny_byte_model(seed=2)
    ctx = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in (37, 30)]
    lm, kl = train_losses(model, ctx)
    with torch.no_grad():
        assert float(lm) == pytest.approx(float(lm_loss(model, ctx, dense_cache_factory)), abs=1e-5)
    assert float(kl.detach()) >= 0.0
    kl.backward()
    idx = [(n, p) for n, p in model.named_parameters() if ".indexer." in n]
    assert idx and all(p.grad is not None and float(p.grad.abs().sum()) > 0 for _, p in idx), \
        [n for n, p in idx if p.grad is None or float(p.grad.abs().sum()) == 0]


def test_a_few_training_steps_lower_the_loss() -> None:
    torch.manual_seed(0)
    model = _tiny_byte_model()
    opt = torch.optim.AdamW(param_groups(model, 0.01), lr=3e-3)
    text = b"def add(a, b):\n    return a + b\n\nclass Point:\n    pass\n" * 3
    data = torch.tensor([BOS] + list(text))
    ctx = [data[:56], data[10:60]]
    losses = []
    for _ in range(5):
        loss = lm_loss(model, ctx, dense_cache_factory)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 0.3
    assert sum(b < a for a, b in zip(losses, losses[1:])) >= 3


def test_dense_and_engine_bits_per_byte_agree_on_a_tiny_model() -> None:
    from kvshare.train.engine_eval import build_llm, engine_bits_per_byte
    from kvshare.train.eval import dense_bits_per_byte

    model = _tiny_byte_model(seed=1)
    g = torch.Generator().manual_seed(0)
    pieces = [torch.randint(32, 127, (n,), generator=g) for n in (70, 45, 90, 12)]
    calls: dict[str, list[tuple[int, int]]] = {"dense": [], "engine": []}
    dense = dense_bits_per_byte(model, pieces, seqs_per_step=3, progress=lambda d, t: calls["dense"].append((d, t)))
    llm = build_llm(model, 96, max_num_batched_tokens=32, max_num_seqs=2)  # forces chunked prefill
    engine = engine_bits_per_byte(llm, pieces, lambda d, t: calls["engine"].append((d, t)))
    assert calls["dense"] == [(3, 4), (4, 4)]  # progress after each step of 3 pieces
    assert calls["engine"][-1] == (4, 4) and len(calls["engine"]) > 4  # chunked: more steps than pieces
    assert math.isfinite(dense) and dense > 0
    assert round(dense, 3) == round(engine, 3) or abs(dense - engine) < 5e-4


def test_byte_baselines_prefer_seen_bytes(tmp_path: Path) -> None:
    stream = torch.tensor([BOS] + list(b"abababab" * 20), dtype=torch.int16)
    ng = ByteNgram(stream)
    bpb = ng.bits_per_byte([torch.tensor(list(b"abab"))])
    assert bpb["bigram"] < bpb["unigram"] < 8.0


def test_wsd_schedule_is_flat_then_cosine() -> None:
    peak, lo = 1e-3, 0.1
    for step in (10, 40, 69):
        assert lr_at(step, 100, peak, 10, lo, decay_start=70) == peak
    for step in (70, 80, 85, 99, 100):
        frac = (step - 70) / 30
        want = peak * (lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * frac)))
        assert lr_at(step, 100, peak, 10, lo, decay_start=70) == pytest.approx(want, rel=1e-12)
    assert lr_at(3, 100, peak, 10, lo, decay_start=70) == pytest.approx(peak * 4 / 10)


def test_training_writes_to_a_run_directory_and_install_is_explicit(tmp_path: Path) -> None:
    from kvshare.weights.checkpoint_write import save_checkpoint
    from kvshare.shipped import MODEL_DIR
    from kvshare.train.install import install
    from kvshare.train.train import DEFAULT_OUT, build_model

    assert not DEFAULT_OUT.is_absolute() and DEFAULT_OUT.parts[0] == "runs"  # never the package by default
    cfg = load_config("kvshare-mini-v41")
    model = Transformer(cfg, quant=True).init_weights(4)
    release = tmp_path / "release"
    save_checkpoint({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, cfg, release)
    # --init-from: the release's (bf16) weights, not the seed's
    again = build_model("kvshare-mini-v41", 0, True, str(release))
    w = "layers.0.attn.wq_a.weight"
    assert torch.equal(again.state_dict()[w], model.state_dict()[w].to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="config differs"):
        build_model("tiny-v41", 0, True, str(release))
    (release / "generation_config.json").write_text('{"temperature": 0.5}')
    dest = tmp_path / "pkg" / "kvshare-mini-v41"
    assert install(release, dest) == ["config.json", "model.safetensors", "generation_config.json"]
    assert (dest / "model.safetensors").read_bytes() == (release / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="MB limit"):
        install(release, dest, max_mb=1.0)
    assert dest.parent != MODEL_DIR


def test_recipe_chains_stage2_onto_stage1_with_the_recorded_schedule(tmp_path: Path) -> None:
    from kvshare.train.recipe import STAGE2_DECAY_START, STAGE2_STEPS, stage_configs

    s1, s2 = stage_configs(tmp_path / "stage1")
    assert (s1.steps, s1.lr, s1.seed, s1.init_from) == (450, 2e-3, 0, "")  # the first release's recipe
    assert s2.init_from == str(tmp_path / "stage1") and s2.seed != s1.seed
    assert 0 < s2.decay_start == STAGE2_DECAY_START < s2.steps == STAGE2_STEPS
    assert s1.minutes >= 1e9 and s2.minutes >= 1e9  # no wall-clock cap: a function of the step counts
