"""`kvshare bench real` (issue 37 items 2-3) on a tiny checkpoint in the release's formats.

* weight bytes a batch-1 decode step reads (`bandwidth.weight_bytes_per_step`) against a count made
  from the safetensors header alone: every stored tensor, minus the routed experts a token does not
  use and all embedding rows but one, with the FP8 scales as the packed kernels hold them (one
  ue8m0 per 16 rows x 128 inputs instead of per 128 x 128; the FP4 experts' bytes are the file's).
  Exact (integers).
* the table logic (`real_table`): best-of rounds, ratios, the bandwidth share, which targets apply
  at which thread count, met / missed.
* the whole command on the tiny checkpoint (real_config patched to it; llama.cpp off): the JSON
  and markdown are written, and kvshare's greedy tokens equal `LLM(checkpoint_dir)`'s (the user's
  default path, loaded separately) and are the same at 1 and 2 threads.
* llama.cpp's side (skipped without the binding or the converter; nothing is downloaded): the
  converter makes MXFP4 experts that are a lossless repack of the stored FP4 bytes (checked
  against a repack written here from ggml's block_mxfp4 layout), Q8_0 from FP8, and a timed
  round runs.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from kvshare.bench.real_table import bandwidth_share, load_rows, speed_rows, summarise
from kvshare.bench.sizes import QUICK, peer_v4_config
from kvshare.config import ModelConfig

# 3 layers (ratios 0 / 4 / 128, what llama.cpp's deepseek4 needs), 64-dim heads and index keys (its
# Hadamard rotation's minimum), 4 routed experts of 64 (FP4: 32-input blocks), top-2
SIZES = QUICK.replace(head_dim=64, index_dim=64, index_heads=16, peer_layers=3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelConfig]:
    from kvshare.bench.real_checkpoint import write_released_checkpoint

    cfg = ModelConfig.from_dict(peer_v4_config(SIZES))
    d = tmp_path_factory.mktemp("real_tiny")
    write_released_checkpoint(cfg, d, seed=0)
    return d, cfg


def _header(path: Path) -> dict:
    with open(path / "model.safetensors", "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    return h


def hand_count(path: Path, cfg: ModelConfig, batch: int) -> int:
    """Weight bytes of one decode step of `batch` tokens, from the file's header (module doc)."""
    h = _header(path)
    size = {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in h.items()}
    total = expert = 0
    for name, v in h.items():
        if name.endswith(".scale") and v["dtype"] == "F8_E8M0" and h[name[:-6] + ".weight"]["dtype"] == "F8_E4M3":
            n, k = h[name[:-6] + ".weight"]["shape"]
            total += -(-n // 16) * -(-k // 128)  # held per 16 rows x 128 inputs
        elif ".experts." in name and ".shared_experts." not in name:
            expert += size[name]
        elif name == "embed.weight":
            total += size[name] // v["shape"][0] * batch
        elif v["dtype"] in ("I64",):  # the hash table is a buffer, not a weight
            continue
        else:
            total += size[name]
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return int(total + expert / E * E * (1 - (1 - k / E) ** batch))


def test_weight_bytes_per_step_counts_the_packed_bytes(tiny) -> None:
    from kvshare.bench.bandwidth import weight_bytes_per_step
    from kvshare.weights.loader import load_model

    path, cfg = tiny
    model = load_model(path, dtype=torch.bfloat16, quant=True)
    # the file's fp32 / bf16 tensors are held as stored except compressor projections, held fp32 (2x)
    h = _header(path)
    comp = sum(v["data_offsets"][1] - v["data_offsets"][0] for n, v in h.items()
               if ".compressor." in n and n.endswith(".weight") and v["dtype"] == "BF16")
    for b in (1, 4):
        assert weight_bytes_per_step(model, cfg.n_routed_experts, cfg.num_experts_per_tok, b) == \
            hand_count(path, cfg, b) + comp


def test_summary_takes_each_measures_best_and_the_table_its_targets() -> None:
    rounds = [{"decode_b1_tok_s": 10.0, "decode_b1_step_s": 0.1, "decode_b4_tok_s": 20.0, "decode_b4_step_s": 0.2,
               "prefill_tok_s": 90.0, "copy_read_gbps": 8.0},
              {"decode_b1_tok_s": 8.0, "decode_b1_step_s": 0.125, "decode_b4_tok_s": 24.0, "decode_b4_step_s": 0.18,
               "prefill_tok_s": 100.0, "copy_read_gbps": 10.0}]
    kv = summarise(rounds)
    assert (kv["decode_b1_tok_s"], kv["decode_b1_step_s"], kv["decode_b4_tok_s"], kv["prefill_tok_s"],
            kv["copy_read_gbps"]) == (10.0, 0.1, 24.0, 100.0, 10.0)
    assert kv["decode_b1_tok_s_median"] == 9.0 and kv["rounds"] == 2
    lc = summarise([{"decode_b1_tok_s": 5.0, "decode_b1_step_s": 0.2, "decode_b4_tok_s": 20.0,
                     "decode_b4_step_s": 0.2, "prefill_tok_s": 40.0}])
    assert bandwidth_share(700_000_000, 0.1, 10.0) == pytest.approx(0.7)
    rows, targets = speed_rows(2, kv, lc, 700_000_000, 512)
    got = {t.name: (round(t.value, 6), t.threshold, t.met) for t in targets}
    assert got == {"decode batch 1 at 2 thread(s), kvshare / llama.cpp": (2.0, 1.5, True),
                   "decode batch 4 at 2 thread(s), kvshare / llama.cpp": (1.2, 1.3, False),
                   "prefill 512 tokens at 2 thread(s), kvshare / llama.cpp": (2.5, 2.0, True),
                   "weight bytes per decode token / copy read bandwidth at 2 thread(s)": (0.7, 0.7, True)}
    assert rows[1][1:5] == ["decode batch 1, median step ms", 100.0, 200.0, 0.5]
    share_row = next(r for r in rows if r[1].startswith("weight bytes per decode token"))
    assert share_row[2:4] == [pytest.approx(0.7), pytest.approx(0.35)]  # the same bytes over llama.cpp's step
    # batch 1's target is stated at 1 and 2 threads only; without llama.cpp only the bandwidth one
    assert not any("batch 1" in t.name for t in speed_rows(4, kv, lc, 1, 512)[1])
    rows, targets = speed_rows(1, kv, None, 700_000_000, 512)
    assert [t.name.split(" at ")[0] for t in targets] == ["weight bytes per decode token / copy read bandwidth"]
    assert rows[0][3] is None and rows[0][4] is None
    lrows, ltargets = load_rows({"checkpoint_bytes": 1e9, "seconds": 2.0, "mb_per_s": 500.0, "peak_growth_bytes": 1.9e9,
                                 "peak_growth_over_file": 1.9, "after_growth_bytes": 1e9,
                                 "generate_peak_growth_bytes": 1.2e9}, None)
    assert [(t.value, t.threshold, t.met) for t in ltargets] == [(1.9, 1.8, False)]
    assert lrows[1][2:5] == [2.0, None, None]


def test_bench_real_command_on_a_tiny_checkpoint(tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    from kvshare.bench import real_checkpoint
    from kvshare.cli import main
    from kvshare.llm import LLM, SamplingParams

    _, cfg = tiny
    ck = tmp_path / "ck"
    monkeypatch.setattr(real_checkpoint, "real_config", lambda *a, **k: cfg)
    rc = main(["bench", "real", "--layers", "3", "--experts", "4", "--vocab", str(cfg.vocab_size), "--threads", "1,2",
               "--repeats", "1", "--prompt-len", "8", "--new-tokens", "4", "--prefill-len", "32", "--copy-mib", "8",
               "--checkpoint", str(ck), "--out-dir", str(tmp_path), "--name", "r", "--no-llamacpp"])
    assert rc == 0
    out = json.loads((tmp_path / "r.json").read_text())
    sec = out["sections"][0]
    assert sec["name"] == "real" and out["header"]["command"].startswith("kvshare bench real --model v4-flash")
    assert sec["data"]["kvshare_tokens_identical_over_threads"]
    assert sec["data"]["kvshare_load"]["peak_growth_bytes"] > 0
    for t in ("1", "2"):
        s = sec["data"]["summary"][t]
        assert s["kvshare"]["decode_b1_tok_s"] > 0 and s["kvshare"]["prefill_tok_s"] > 0 and s["llamacpp"] is None
    assert "| target |" in (tmp_path / "r.md").read_text()
    # the same tokens as the user's default path, LLM(dir), on its own load of the checkpoint
    from kvshare.bench.gen import equal_length_prompts

    prompt = equal_length_prompts(1, 8, cfg.vocab_size, 1).tolist()
    llm = LLM(str(ck), max_num_seqs=1, max_model_len=16)
    ref = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert sec["data"]["runs"]["1"]["kvshare"][0]["tokens_b1"] == [list(ref[0].token_ids)]
    shutil.rmtree(ck)


def test_thread_list_is_for_real_only(capsys: pytest.CaptureFixture) -> None:
    from kvshare.cli import main

    assert main(["bench", "peer", "--threads", "1,2", "--no-plots"]) == 2
    assert "--threads takes one count" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "real", "--threads", "0"])


def _repack_mxfp4(codes: torch.Tensor, scale: torch.Tensor) -> bytes:
    """ggml's block_mxfp4 per 32 inputs: the e8m0 byte, then 16 bytes whose byte j holds input j (low
    nibble) and input j + 16 (high); the stored FP4 byte i holds input 2i (low) and 2i + 1 (high)."""
    u = codes.view(torch.uint8).to(torch.int32)
    n = u.shape[0]
    vals = torch.stack((u & 15, u >> 4), dim=-1).reshape(n, -1, 32)  # [n, blocks, 32] nibbles in input order
    qs = (vals[..., :16] | (vals[..., 16:] << 4)).to(torch.uint8)
    blocks = torch.cat((scale.view(torch.uint8).reshape(n, -1, 1), qs), dim=-1)
    return blocks.numpy().tobytes()


def test_llamacpp_converts_the_released_checkpoint_and_runs(tiny) -> None:
    import sys

    from kvshare.bench import llamacpp_files as files

    converter = files.converter_dir()
    if converter is None or files.binding_available() is not None:
        pytest.skip(f"llama.cpp's converter ({files.cache_dir()}) or binding is not available; nothing is fetched")
    from safetensors.torch import load_file

    from kvshare.bench.llamacpp_peer import LlamaCppModel
    from kvshare.bench.real_llamacpp import lc_round, measure_lc_load, released_gguf

    path, cfg = tiny
    gguf_path, note = released_gguf(path, cfg, fetch=False)
    assert gguf_path is not None, note
    sys.path.insert(0, str(converter / "gguf-py"))
    try:
        from gguf import GGUFReader
    finally:
        sys.path.remove(str(converter / "gguf-py"))
    tensors = {t.name: t for t in GGUFReader(gguf_path).tensors}
    state = load_file(path / "model.safetensors")
    for layer in range(cfg.num_hidden_layers):
        for proj, key in (("w1", "gate"), ("w2", "down"), ("w3", "up")):
            t = tensors[f"blk.{layer}.ffn_{key}_exps.weight"]
            assert t.tensor_type.name == "MXFP4"
            want = b"".join(_repack_mxfp4(state[f"layers.{layer}.ffn.experts.{e}.{proj}.weight"],
                                          state[f"layers.{layer}.ffn.experts.{e}.{proj}.scale"])
                            for e in range(cfg.n_routed_experts))
            assert t.data.tobytes() == want  # lossless: the same codes and scales, moved
        assert tensors[f"blk.{layer}.attn_q_b.weight"].tensor_type.name == "Q8_0"  # FP8 in the checkpoint
        assert tensors[f"blk.{layer}.ffn_up_shexp.weight"].tensor_type.name == "Q8_0"
    assert tensors["output.weight"].tensor_type.name == "BF16"  # bf16 in the checkpoint
    assert released_gguf(path, cfg, fetch=False)[1].startswith("llama.cpp: reused")
    load = measure_lc_load(gguf_path, 1, cfg.vocab_size)
    assert load["checkpoint_bytes"] == gguf_path.stat().st_size and load["seconds"] > 0 and len(load["tokens"]) == 8
    from kvshare.bench.gen import equal_length_prompts

    m = LlamaCppModel(gguf_path, "released")
    try:
        prompts = {"b1": equal_length_prompts(1, 8, cfg.vocab_size, 1), "b4": equal_length_prompts(4, 8, cfg.vocab_size, 4),
                   "prefill": equal_length_prompts(1, 32, cfg.vocab_size, 2)}
        r = lc_round(m, 1, prompts, 3)
    finally:
        m.close()
    assert r["decode_b1_tok_s"] > 0 and r["decode_b4_tok_s"] > 0 and r["prefill_tok_s"] > 0
    assert [len(s) for s in r["tokens_b4"]] == [3] * 4


def test_llamacpp_refuses_a_stack_without_a_compressed_layer() -> None:
    from kvshare.bench.llamacpp_peer import unsupported
    from kvshare.bench.real_checkpoint import real_config

    # observed: llama.cpp 0.3.36 dies of SIGFPE creating a context for V4 layers of ratio 0 only
    assert "needs a compressed layer" in unsupported(real_config("v4-flash", 2, 8))
    assert unsupported(real_config("v4-flash", 3, 8)) is None
