"""llama.cpp as a benchmark peer: the GGUF conversion and llama.cpp's V4 graph against kvshare (fp32).

Needs llama.cpp's converter (``KVSHARE_LLAMACPP_SRC`` or the bench's cache, see
bench/llamacpp_files.py) and, for the logits tests, ``llama-cpp-python``; without them the tests
are skipped: they never download or build anything.

* The GGUF holds the checkpoint's tensors unchanged: routed experts stacked per projection,
  the hash table as I32, every value equal to kvshare's (read back with llama.cpp's own reader).
* llama.cpp on the f32 GGUF, with its attention in fp32 (f32 KV cache, flash attention off: its
  CPU kernel rounds to f16), reproduces kvshare's fp32 logits (the quick bench model with 64-dim
  heads and index keys, the smallest llama.cpp's Hadamard rotation takes, and 16 index heads:
  ratios 0/4/128/4, a hash layer, YaRN; 140 tokens: an HCA entry and 35 CSA entries against top-8,
  so the indexer selects), for the whole prompt, and for one token per step after a 114-token
  prefill with two sequences in one context (the benchmark's batch), each against kvshare on that
  sequence alone. The index scores are checked to have no near-tie at the top-k boundary: with 4
  index heads (the quick preset) ReLU makes scores exactly 0 often enough that tied entries meet
  the boundary, and llama.cpp's top-k breaks those ties differently from kvshare's (lower
  position first), which changes a few picks and the logits by up to 0.4.
* Configs llama.cpp would abort on, a missing binding and a missing converter (with fetching off)
  are refused with a reason instead, nothing converted or downloaded.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvshare.bench import llamacpp_files as files
from kvshare.bench.llamacpp_peer import unsupported
from kvshare.bench.sizes import QUICK, peer_v4_config
from kvshare.config import ModelConfig, load_config
from kvshare.weights.checkpoint_write import save_checkpoint

CONVERTER = files.converter_dir()
needs_converter = pytest.mark.skipif(CONVERTER is None, reason="llama.cpp's converter is not available "
                                     f"(set KVSHARE_LLAMACPP_SRC or fill {files.cache_dir()})")
needs_binding = pytest.mark.skipif(files.binding_available() is not None,
                                   reason=str(files.binding_available()))

SEQ = 140  # as test_hf_oracle: one ratio-128 entry, 35 ratio-4 entries against index_topk 8
PREFIX = 114
# Observed max |llama.cpp - kvshare| over all logits (magnitudes up to ~4.6): 5.2e-6 prefill, 2.9e-6 decode.
ATOL = 2e-5
MIN_GAP = 1e-5  # smallest allowed kvshare index-score gap at the top-k boundary


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The quick peer model with 64-dim heads and index keys in fp32, seeded weights, its f32 GGUF."""
    from kvshare.model.deepseek import Transformer

    cfg = ModelConfig.from_dict(peer_v4_config(QUICK.replace(head_dim=64, index_dim=64, index_heads=16)))
    assert unsupported(cfg) is None and cfg.index_topk < SEQ // 4
    model = Transformer(cfg, quant=False).init_weights(0).float().eval()
    out = tmp_path_factory.mktemp("gguf")
    ckpt = save_checkpoint(model, cfg, out / "ckpt")
    gguf_path = files.convert_checkpoint(ckpt, out / "tiny-f32.gguf", CONVERTER, "f32") if CONVERTER else None
    return {"cfg": cfg, "model": model, "gguf": gguf_path}


@needs_converter
def test_gguf_holds_the_checkpoint(tiny: dict) -> None:
    sys.path.insert(0, str(CONVERTER / "gguf-py"))
    try:
        from gguf import GGUFReader
    finally:
        sys.path.remove(str(CONVERTER / "gguf-py"))
    cfg, sd = tiny["cfg"], tiny["model"].state_dict()
    reader = GGUFReader(tiny["gguf"])
    tensors = {t.name: t for t in reader.tensors}
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert fields["general.architecture"] == "deepseek4" and fields["tokenizer.ggml.model"] == "none"
    assert fields["deepseek4.vocab_size"] == cfg.vocab_size
    assert fields["deepseek4.attention.compress_ratios"] == list(cfg.compress_ratios)

    def arr(name: str) -> np.ndarray:
        t = tensors[name]
        return np.asarray(t.data).reshape(list(reversed([int(x) for x in t.shape])))

    for il in range(cfg.num_hidden_layers):
        for proj, key in (("w1", "gate"), ("w2", "down"), ("w3", "up")):
            want = torch.stack([sd[f"layers.{il}.ffn.experts.{e}.{proj}.weight"] for e in range(cfg.n_routed_experts)])
            np.testing.assert_array_equal(arr(f"blk.{il}.ffn_{key}_exps.weight"), want.numpy())
        np.testing.assert_array_equal(arr(f"blk.{il}.attn_q_a.weight"), sd[f"layers.{il}.attn.wq_a.weight"].numpy())
    assert tensors["blk.0.ffn_gate_tid2eid.weight"].tensor_type.name == "I32"
    np.testing.assert_array_equal(arr("blk.0.ffn_gate_tid2eid.weight"), sd["layers.0.ffn.gate.tid2eid"].numpy())
    np.testing.assert_array_equal(arr("token_embd.weight"), sd["embed.weight"].numpy())


def _ks_logits(model: torch.nn.Module, ids: torch.Tensor, prefix: int | None,
               monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """kvshare fp32 logits: every position of one prefill, or a `prefix` prefill then one token per
    step; asserts that no index-score row has a near-tie at the top-k boundary."""
    import kvshare.layers.index_select as indexer  # the module whose select_topk the indexer calls
    from kvshare.cache.dense import DenseCache
    from kvshare.step import StepBatch

    gaps: list[float] = []
    select = indexer.select_topk

    def recording(scores: torch.Tensor, compress_len: torch.Tensor, k: int) -> torch.Tensor:
        top = scores.topk(min(k + 1, scores.shape[-1]), dim=-1).values
        if top.shape[-1] > k:
            ok = torch.isfinite(top[:, k])
            gaps.extend((top[:, k - 1] - top[:, k])[ok].tolist())
        return select(scores, compress_len, k)

    monkeypatch.setattr(indexer, "select_topk", recording)
    cache = DenseCache(model.cfg, model.topo, 1, SEQ)
    with torch.inference_mode():
        if prefix is None:
            out = model.forward(ids, StepBatch.build([0], [ids.numel()]), cache)
            assert gaps and min(gaps) > MIN_GAP, min(gaps)
            return out
        model.forward(ids[:prefix], StepBatch.build([0], [prefix]), cache)
        out = torch.cat([model.forward(ids[t:t + 1], StepBatch.build([t], [1]), cache) for t in range(prefix, SEQ)])
    assert gaps and min(gaps) > MIN_GAP, min(gaps)  # the indexer selected, and without near-ties
    return out


@pytest.fixture(scope="module")
def lc(tiny: dict):
    from kvshare.bench.llamacpp_peer import LlamaCppModel

    m = LlamaCppModel(tiny["gguf"], "f32")
    yield m
    m.close()


def _prompt(cfg, seed: int) -> torch.Tensor:
    return torch.randint(3, cfg.vocab_size, (SEQ,), generator=torch.Generator().manual_seed(seed))


@needs_converter
@needs_binding
def test_llamacpp_prefill_matches_kvshare(tiny: dict, lc, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvshare.bench.llamacpp_peer import LlamaCppSession

    ids = _prompt(tiny["cfg"], 1)
    want = _ks_logits(tiny["model"], ids, None, monkeypatch)
    sess = LlamaCppSession(lc, 1, SEQ, SEQ, fp32_attention=True)
    try:
        got = sess.prefill([ids.tolist()], all_logits=True)[0]
    finally:
        sess.close()
    assert got.shape == tuple(want.shape)
    err = np.abs(got - want.numpy()).max()
    print(f"prefill max |llama.cpp - kvshare| = {err:.3g}")
    assert err < ATOL, err


@needs_converter
@needs_binding
def test_llamacpp_decode_and_batch_match_kvshare(tiny: dict, lc, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvshare.bench.llamacpp_peer import LlamaCppSession

    seqs = [_prompt(tiny["cfg"], 2), _prompt(tiny["cfg"], 3)]
    want = [_ks_logits(tiny["model"], ids, PREFIX, monkeypatch).numpy() for ids in seqs]
    sess = LlamaCppSession(lc, 2, SEQ + 1, 2 * PREFIX, fp32_attention=True)
    try:  # both sequences in one context: prefill together, then one token of each per step
        rows = [[r] for r in sess.prefill([ids[:PREFIX].tolist() for ids in seqs])]
        for t in range(PREFIX, SEQ):
            for acc, r in zip(rows, sess.step([int(ids[t]) for ids in seqs])):
                acc.append(r)
    finally:
        sess.close()
    for acc, w in zip(rows, want):
        got = np.concatenate(acc)
        # row 0 is the prefill's (after token PREFIX - 1); then, like kvshare's rows, after tokens PREFIX..SEQ-1
        print(f"decode max |llama.cpp - kvshare| = {np.abs(got[1:] - w).max():.3g}")
        np.testing.assert_allclose(got[1:], w, rtol=0, atol=ATOL)
    assert np.abs(np.concatenate(rows[0]) - np.concatenate(rows[1])).max() > 1e-2  # the sequences stay apart


def test_configs_llamacpp_would_abort_on_are_refused() -> None:
    assert "index_head_dim must be a multiple of 64 (got 16)" in unsupported(load_config("tiny-v4"))
    assert "DeepSeek-V4 models only" in unsupported(load_config("tiny-v41"))
    assert unsupported(ModelConfig.from_dict(peer_v4_config(QUICK.replace(index_dim=64)))) is None


@pytest.mark.slow  # ~15 s: four GGUF conversions and a benchmark run
@needs_converter
@needs_binding
def test_bench_peer_runs_llamacpp(tmp_path: Path) -> None:
    """`kvshare bench peer --quick` with llama.cpp-sized index keys: llama.cpp rows (checkpoint dtype
    and q8_0) in the peer and released-sizes sections, their tokens compared with kvshare's, and
    llama.cpp columns in the side-by-side table."""
    import json

    from kvshare.cli import main

    sizes = ["--index-dim", "64", "--prefill-index-dim", "64", "--index-heads", "16"]
    assert main(["bench", "peer", "--quick", "--no-plots", "--no-fetch", "--no-peer", "--out-dir", str(tmp_path),
                 "--name", "p", *sizes]) == 0
    out = {s["name"]: s for s in json.loads((tmp_path / "p.json").read_text())["sections"]}
    for run in out["peer"]["data"]["runs"]:
        assert set(run["llamacpp"]) == {"bf16", "q8_0"}
        for lc in run["llamacpp"].values():
            cmp = lc["tokens_vs_kvshare"]
            assert cmp["sequences"] == run["batch"] and len(cmp["first_divergence"]) == run["batch"]
            assert lc["result"]["decode_tok_s"] > 0 and lc["result"]["prefill_tok_s"] > 0
    assert set(out["prefill"]["data"]["llamacpp"]) == {"bf16", "q8_0"}
    assert out["peer-summary"]["columns"] == ["throughput", "kvshare", "llama.cpp bf16", "llama.cpp q8_0"]
    assert all(v is not None for row in out["peer-summary"]["rows"] for v in row)



def test_open_peers_says_why_llamacpp_is_skipped(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without the binding, or without the converter when fetching is off, no model is opened and the
    report gets the reason (nothing is converted or downloaded)."""
    from kvshare.bench.llamacpp_peer import open_peers

    cfg = ModelConfig.from_dict(peer_v4_config(QUICK.replace(index_dim=64)))
    monkeypatch.setattr(files, "binding_available", lambda: "llama-cpp-python is not installed")
    assert open_peers(None, cfg, "bfloat16", tmp_path, fetch=False) == ([], "llama-cpp-python is not installed")
    monkeypatch.setattr(files, "binding_available", lambda: None)
    monkeypatch.setattr(files, "converter_dir", lambda: None)
    models, reason = open_peers(None, cfg, "bfloat16", tmp_path, fetch=False)
    assert models == [] and "converter is not in" in reason and "KVSHARE_LLAMACPP_SRC" in reason
    assert open_peers(None, load_config("tiny-v4"), "bfloat16", tmp_path, fetch=False)[1].startswith(
        "llama.cpp's deepseek4 rotates index keys")
    assert not list(tmp_path.iterdir())
