"""kvshare reads what transformers' `save_pretrained` writes, and writes what transformers reads.

A small random transformers `DeepseekV4ForCausalLM` (layers of ratio 0 / 4 / 128, hash and routed
MoE, 16 index heads, fp32, eager) is built from a config written out here by hand, its weights drawn
from a seeded generator (transformers' own init leaves norms at 1 and biases at 0), and saved with
`save_pretrained`. kvshare loads that directory (config.json and weights as transformers wrote them,
no kvshare code in between) and must give the same logits on the same prompts, and the same greedy
tokens through its engine, as transformers. The prompts are long enough for ratio-128 entries and for
the index top-k to choose (35 ratio-4 entries against top-4); near-ties at any top-k boundary are
measured and must be absent, or the comparison would be meaningless.

The round trip kvshare -> `export_transformers` -> transformers `from_pretrained` -> `save_pretrained`
-> kvshare must give identical tensors, and so must `kvshare convert` both ways.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvshare.weights.loader import load_checkpoint, load_model
from kvshare.weights.checkpoint_write import export_transformers
from kvshare.step import StepBatch

transformers = pytest.importorskip("transformers", reason="transformers is not installed: no HF oracle")
from test_hf_oracle import GapRecorder  # noqa: E402  (same directory; pytest puts it on sys.path)

PROMPT_LENS = (140, 70)  # 140 > 128: one ratio-128 entry; 35 ratio-4 entries against index_topk 4
NEW_TOKENS = 6
LOGIT_ATOL = 1e-5  # issue 18's bound; observed max |diff| 4.8e-06 (fp32, logits up to ~4.1)
MIN_GAP = 1e-5  # smallest allowed score gap at a top-k boundary


def hf_config():
    """Three layers: sliding window (hash MoE), ratio 4 (CSA + indexer), ratio 128 (HCA); YaRN compress rope."""
    cfg = transformers.DeepseekV4Config(
        vocab_size=256, hidden_size=32, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, q_lora_rank=16, partial_rotary_factor=0.5, num_experts_per_tok=2,
        n_routed_experts=4, n_shared_experts=1, scoring_func="sqrtsoftplus", norm_topk_prob=True,
        routed_scaling_factor=1.5, max_position_embeddings=4096, rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_parameters={
            "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "partial_rotary_factor": 0.5, "factor": 4.0,
                         "attention_factor": 1.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
                         "beta_slow": 1.0}},
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        mlp_layer_types=["hash_moe", "moe", "moe"], hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=10.0,
        sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=16, index_head_dim=16, index_topk=4,
        num_nextn_predict_layers=0, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        tie_word_embeddings=False, hidden_act="silu")
    cfg._attn_implementation = "eager"
    return cfg


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights of a sensible scale: matrices ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1), other vectors
    ~ N(0, 0.3); each hash-layer token maps to `num_experts_per_tok` distinct experts."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("tid2eid"):
                e, k = model.config.n_routed_experts, model.config.num_experts_per_tok
                t.copy_(torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t.shape[0])]))
            elif "norm" in name:
                t.copy_(1 + 0.1 * torch.randn(t.shape, generator=g))
            elif t.dim() >= 2:
                t.copy_(torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5)
            else:
                t.copy_(0.3 * torch.randn(t.shape, generator=g))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)  # transformers' own init, overwritten by `randomize`
    hf = transformers.DeepseekV4ForCausalLM(hf_config()).float().eval()
    randomize(hf, 7)
    out = tmp_path_factory.mktemp("hf") / "saved"
    hf.save_pretrained(out)
    return out, hf


def prompts(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=g) for n in PROMPT_LENS]


def ks_logits(ks, ids: torch.Tensor) -> torch.Tensor:
    from kvshare.cache.dense import DenseCache

    return ks.forward(ids, StepBatch.build([0], [ids.numel()]), DenseCache(ks.cfg, ks.topo, 1, ids.numel()))


def ks_greedy(ks, seqs: list[torch.Tensor]) -> list[list[int]]:
    """Greedy continuations from kvshare's engine (paged cache, continuous batching)."""
    from kvshare.engine.engine import LLMEngine
    from kvshare.engine.sampling import SamplingParams

    eng = LLMEngine(ks, max_model_len=256, num_blocks=16, block_size=128, max_num_seqs=len(seqs))
    for i, s in enumerate(seqs):
        eng.add_request(str(i), s.tolist(), SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    done: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: list(o.token_ids) for o in eng.step() if o.finished})
    return [done[str(i)] for i in range(len(seqs))]


def test_kvshare_matches_transformers_on_a_saved_checkpoint(saved) -> None:
    path, hf = saved
    ks = load_model(path, quant=False)
    ks.record_ties(True)
    seqs = prompts(ks.cfg.vocab_size)
    with torch.no_grad():
        hf_tokens = [hf.generate(s[None], max_new_tokens=NEW_TOKENS, do_sample=False)[0, s.numel():].tolist()
                     for s in seqs]
        assert ks_greedy(ks, seqs) == hf_tokens
        rec = GapRecorder(hf, ks.cfg)  # the full passes below make every top-k choice the decode steps made
        worst = 0.0
        for s, new in zip(seqs, hf_tokens):
            full = torch.cat([s, torch.tensor(new)])
            rec.positions = torch.arange(full.numel())
            want = hf(input_ids=full[None]).logits[0]
            got = ks_logits(ks, full)
            worst = max(worst, (got - want).abs().max().item())
    gap, where = rec.min_gap()
    assert gap > MIN_GAP, f"near-tie at a top-k boundary in {where}: gap {gap:.3e}"
    assert not ks.tie_log, f"kvshare saw exact top-k ties: {ks.tie_log}"
    assert worst <= LOGIT_ATOL, f"max |logit diff| {worst:.3e}"


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())[:5]
    bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not bad, bad[:5]


def test_round_trip_through_transformers_is_exact(saved, tmp_path: Path) -> None:
    path, _ = saved
    ks = load_model(path, quant=False)
    export_transformers(ks, ks.cfg, tmp_path / "export")
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path / "export")
    hf.save_pretrained(tmp_path / "resaved")
    back = load_model(tmp_path / "resaved", quant=False)
    assert back.cfg == ks.cfg
    _same(back.state_dict(), ks.state_dict())


def test_convert_cli_both_ways(saved, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from kvshare.cli import main

    path, hf = saved
    assert main(["convert", "--to", "released", str(path), str(tmp_path / "rel")]) == 0
    assert main(["convert", "--to", "released", str(path), str(tmp_path / "rel")]) == 2
    assert "already holds safetensors weights" in capsys.readouterr().err
    assert main(["convert", "--to", "transformers", str(tmp_path / "rel"), str(tmp_path / "hf")]) == 0
    again = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path / "hf")
    _same(again.state_dict(), hf.state_dict())
    cfg = load_model(path, quant=False).cfg
    _same(load_checkpoint(tmp_path / "rel", cfg), load_checkpoint(path, cfg))
