"""Shared helpers for the model tests, plus construction tests (names, refusals, topology wiring).

`cand_config()` is the V4.1 test model whose candidate level restricts selection at short lengths
and which exercises every role: 0 SWA; 1 Full (ratio 2); 2 Reindex (ratio 2, index keys of 1);
3 Reuse of 2; 4 Full (ratio 1) + candidate source; 5 Reuse of 4; 6 Reindex (ratio 1, keys of 4,
consumes candidates: 3 blocks of 4 positions); 7 Reuse of 6. It has 16 index heads.
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

import pytest
import torch

from kvshare.config import ModelConfig, load_config
from kvshare.cache.dense import DenseCache
from kvshare.model import Transformer
from kvshare.step import StepBatch, StepState
from kvshare.shipped import resolve_config_path
from kvshare.topology import Role, Topology

MAX_LEN = 160



def cand_config(**overrides: Any) -> ModelConfig:
    raw = json.loads(open(resolve_config_path("tiny-v41")).read())
    raw.update({
        "num_hidden_layers": 8,
        "compress_ratios": [0, 2, 2, 2, 1, 1, 1, 1],
        "kv_source_layer_ids": [1, 4],
        "index_source_layer_ids": [1, 2, 4, 6],
        "candidate_source_layer_id": 4,
        "candidate_topk_blocks": 3,
        "candidate_block_size": 4,
        "index_topk": 5,
        "index_n_heads": 16,
        "num_nextn_predict_layers": 0,
    })
    raw.update(overrides)
    return ModelConfig.from_dict(raw)


def get_config(name: str) -> ModelConfig:
    return cand_config() if name == "cand" else load_config(name)


def make_model(name: str, quant: bool = False, seed: int = 0, **kw: Any) -> Transformer:
    cfg = get_config(name)
    return Transformer(cfg, Topology(cfg, **kw) if kw else None, quant=quant).init_weights(seed).eval()


def token_ids(cfg: ModelConfig, n: int, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def run_chunks(model: Transformer, ids: torch.Tensor, chunks: list[int], cache: DenseCache | None = None,
               slot: int = 0, states: list[StepState] | None = None) -> torch.Tensor:
    """Logits of every token of one sequence fed in the given chunk sizes."""
    cache = cache or DenseCache(model.cfg, model.topo, 2, MAX_LEN, dtype=model.embed.weight.dtype)
    out, s = [], 0
    with torch.no_grad():
        for n in chunks:
            st = StepState()
            out.append(model(ids[s:s + n], StepBatch.build([s], [n], [slot]), cache, st))
            if states is not None:
                states.append(st)
            s += n
    assert s == ids.numel()
    return torch.cat(out)


def random_chunks(total: int, seed: int, most: int = 9) -> list[int]:
    rng, out = random.Random(seed), []
    while sum(out) < total:
        out.append(min(rng.randint(1, most), total - sum(out)))
    return out


# Self-consistency runs are float64 inside; logits come back fp32, so two runs whose float64 logits
# differ by ~1e-15 can still round to neighbouring fp32 values (1 ulp = 4.8e-7 for |logit| in [4, 8)).
# Observed max |diff| over every assert_close in test_model_{consistency,batching,roles,v4}: 0.
FP32_LOGIT_ULPS = 1e-6


def assert_close(a: torch.Tensor, b: torch.Tensor, atol: float = FP32_LOGIT_ULPS, what: str = "") -> None:
    err = (a - b).abs().amax(-1)
    assert err.max().item() <= atol, f"{what}: max |diff| {err.max().item():.3e} first bad row " \
                                     f"{int((err > atol).nonzero()[0])}"
    assert torch.equal(a.argmax(-1), b.argmax(-1)), f"{what}: greedy tokens differ"


# ---- construction tests -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-v41", "tiny-v41-deep", "tiny-v4", "cand", "tiny-v41-engram"])
def test_state_dict_names_match_released_naming(name: str) -> None:
    from kvshare.weights.hf_naming import released_shapes

    cfg = get_config(name)
    sd = Transformer(cfg).state_dict()
    expected = released_shapes(cfg)
    assert set(sd) == set(expected)
    assert all(tuple(sd[k].shape) == tuple(expected[k]) for k in sd)


def test_v41_flash_names_on_meta_device() -> None:
    from kvshare.weights.hf_naming import released_shapes

    # 8 experts instead of 384 keep construction fast; attention naming is the released one.
    cfg = dataclasses.replace(load_config("deepseek-v4.1-flash"), engram_layer_ids=(), n_routed_experts=8)
    with torch.device("meta"):
        model = Transformer(cfg)
    sd = model.state_dict()
    assert set(sd) == set(released_shapes(cfg))
    assert "layers.24.attn.indexer.wq_b.weight" in sd and "layers.24.attn.indexer.wk.weight" not in sd
    assert "layers.20.attn.indexer.wk.weight" in sd and "layers.20.attn.compressor.wgate.weight" not in sd
    assert "layers.2.attn.compressor.wgate.weight" in sd and "layers.3.attn.compressor.wkv.weight" not in sd
    assert "hc_head_fn" not in sd and not any(k.startswith("mtp.") for k in sd)


def test_cand_config_roles() -> None:
    topo = Topology(cand_config())
    assert [topo[i].role for i in range(8)] == [Role.SWA, Role.FULL, Role.REINDEX, Role.REUSE, Role.FULL,
                                                Role.REUSE, Role.REINDEX, Role.REUSE]
    assert topo[2].index_k_source == 1 and topo[6].index_k_source == 4 and topo[6].uses_candidates
