"""transformers' DeepSeek-V4 as an fp32 oracle for the kvshare model (quantisation off).

The kvshare `Transformer` is built with random weights (its `init_weights`), the weights are mapped
to transformers' `DeepseekV4ForCausalLM` (eager attention, fp32) with `hf_naming`, and logits are
compared for a full prefill and for token-by-token decode (transformers with its cache, kvshare with
`DenseCache`). The config mixes sliding, ratio-4 (CSA, indexer) and ratio-128 (HCA) layers and hash
and routed MoE; the sequence is long enough for ratio-128 entries and for the index top-k to select
(index_topk < reachable entries). Near-ties at any top-k boundary (indexer, experts) would make the
comparison meaningless, so they are measured and must be absent.

Known HF vs reference differences (spec/model.md §12 item 8) that do not matter here: no
fake-quant, no Hadamard (q . k invariant), W-1 cached window tokens plus the new one (= W entries),
routing weights always renormalised with + 1e-20, routing applied after `down_proj` (linear).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvshare.config import ModelConfig, load_config
from kvshare.weights.hf_naming import kvshare_to_transformers, transformers_config_dict
from kvshare.step import StepBatch

transformers = pytest.importorskip("transformers", reason="transformers is not installed: no HF oracle")
DeepseekV4Config = transformers.DeepseekV4Config
DeepseekV4ForCausalLM = transformers.DeepseekV4ForCausalLM
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_mod  # noqa: E402

pytestmark = pytest.mark.usefixtures("small_prefill_paths")  # prefill runs its fast paths

SEQ = 140  # > 128: one HCA entry; 35 ratio-4 entries against index_topk 4
PREFIX = 114  # prefill length before decode: leaves a partial ratio-4 window; decode crosses 127 (HCA entry)
ATOL = 1e-4
SHORT = 70  # second sequence of the ragged batch
MIN_GAP = 1e-5  # smallest allowed score gap at a top-k boundary


def oracle_config() -> ModelConfig:
    """tiny-v4 (ratios 0/4/128/4/0/4, 1 hash layer, 8 index heads, top-4, window 8, YaRN)."""
    cfg = load_config("tiny-v4")
    assert cfg.num_hash_layers >= 1 and cfg.index_n_heads >= 8
    assert {0, 4, 128} <= set(cfg.compress_ratios[: cfg.num_hidden_layers])
    assert cfg.index_topk < (SEQ // 4) and SEQ >= 130
    return cfg


class GapRecorder:
    """Forward hooks on transformers' indexer scorer and routers: the score gap at each top-k boundary."""

    def __init__(self, model: torch.nn.Module, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.gaps: list[tuple[float, str]] = []
        self.handles = []
        for name, mod in model.named_modules():
            if isinstance(mod, hf_mod.DeepseekV4IndexerScorer):
                self.handles.append(mod.register_forward_hook(self._indexer(name)))
            elif isinstance(mod, hf_mod.DeepseekV4TopKRouter):
                self.handles.append(mod.register_forward_hook(self._router(name, mod)))
        self.positions: torch.Tensor | None = None

    def _record(self, scores: torch.Tensor, k: int, what: str) -> None:
        top = scores.topk(k + 1, dim=-1).values
        ok = torch.isfinite(top[..., k])
        if ok.any():
            gap = (top[..., k - 1] - top[..., k])[ok].min().item()
            self.gaps.append((gap, what))

    def _indexer(self, name: str):
        def hook(mod, args, out):
            pos = self.positions
            n = (pos + 1) // 4
            masked = out[0].masked_fill(torch.arange(out.shape[-1])[None, :] >= n[:, None], float("-inf"))
            if masked.shape[-1] > self.cfg.index_topk:
                self._record(masked, self.cfg.index_topk, name)
        return hook

    def _router(self, name: str, mod):
        def hook(m, args, out):
            scores = m.score_fn(out[0]) + m.e_score_correction_bias
            self._record(scores, self.cfg.num_experts_per_tok, name)
        return hook

    def min_gap(self) -> tuple[float, str]:
        return min(self.gaps) if self.gaps else (float("inf"), "none")


def build_pair(cfg: ModelConfig, seed: int = 0):
    from kvshare.model.deepseek import Transformer

    ks = Transformer(cfg, quant=False).init_weights(seed).float().eval()
    hcfg = DeepseekV4Config(**transformers_config_dict(cfg))
    hcfg._attn_implementation = "eager"
    hf = DeepseekV4ForCausalLM(hcfg).float().eval()
    missing, unexpected = hf.load_state_dict(kvshare_to_transformers(ks.state_dict(), cfg), strict=False)
    assert not unexpected, unexpected
    assert all(k.endswith("inv_freq") for k in missing), missing
    return ks, hf


def ks_prefill(ks, ids: torch.Tensor) -> torch.Tensor:
    from kvshare.cache.dense import DenseCache

    cache = DenseCache(ks.cfg, ks.topo, 1, SEQ)
    return ks.forward(ids, StepBatch.build([0], [ids.numel()]), cache)


def ks_decode(ks, ids: torch.Tensor) -> torch.Tensor:
    """kvshare logits of positions PREFIX..SEQ-1: a prefill of PREFIX tokens, then one token per step."""
    from kvshare.cache.dense import DenseCache

    cache = DenseCache(ks.cfg, ks.topo, 1, SEQ)
    ks.forward(ids[:PREFIX], StepBatch.build([0], [PREFIX]), cache)
    rows = [ks.forward(ids[t:t + 1], StepBatch.build([t], [1]), cache) for t in range(PREFIX, SEQ)]
    return torch.cat(rows)


def hf_run(hf, ids: torch.Tensor, rec: GapRecorder) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers logits: (full prefill [SEQ], prefill of PREFIX then one token per step [SEQ-PREFIX])."""
    rec.positions = torch.arange(SEQ)
    full = hf(input_ids=ids[None]).logits[0]
    rec.positions = torch.arange(PREFIX)
    out = hf(input_ids=ids[None, :PREFIX], use_cache=True)
    rows, pkv = [], out.past_key_values
    for t in range(PREFIX, SEQ):
        rec.positions = torch.tensor([t])
        out = hf(input_ids=ids[None, t:t + 1], past_key_values=pkv, use_cache=True)
        pkv = out.past_key_values
        rows.append(out.logits[0])
    return full, torch.cat(rows)


def ks_batched(ks, seqs: list[torch.Tensor], chunks: list[int]) -> list[torch.Tensor]:
    """kvshare logits of several sequences prefilled together, in steps of `chunks` tokens each."""
    from kvshare.cache.dense import DenseCache

    cache = DenseCache(ks.cfg, ks.topo, len(seqs), SEQ)
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    start = 0
    for c in chunks:
        live = [i for i, s in enumerate(seqs) if start < s.numel()]
        lens = [min(c, seqs[i].numel() - start) for i in live]
        ids = torch.cat([seqs[i][start:start + n] for i, n in zip(live, lens)])
        logits = ks.forward(ids, StepBatch.build([start] * len(live), lens, live), cache)
        for i, part in zip(live, logits.split(lens)):
            outs[i].append(part)
        start += c
    return [torch.cat(o) for o in outs]


@dataclasses.dataclass
class OracleRun:
    hf_full: torch.Tensor
    hf_decode: torch.Tensor
    hf_short: torch.Tensor
    ks_full: torch.Tensor
    ks_decode: torch.Tensor
    ks_batched: list[torch.Tensor]
    gap: tuple[float, str]
    ks_ties: list


@pytest.fixture(scope="module")
def run() -> OracleRun:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threading only adds contention
    try:
        cfg = oracle_config()
        ks, hf = build_pair(cfg)
        ks.record_ties(True)
        g = torch.Generator().manual_seed(123)
        ids = torch.randint(0, cfg.vocab_size, (SEQ,), generator=g)
        short = torch.randint(0, cfg.vocab_size, (SHORT,), generator=g)
        rec = GapRecorder(hf, cfg)
        with torch.no_grad():
            hf_full, hf_dec = hf_run(hf, ids, rec)
            rec.positions = torch.arange(SHORT)
            hf_short = hf(input_ids=short[None]).logits[0]
            return OracleRun(hf_full, hf_dec, hf_short, ks_prefill(ks, ids), ks_decode(ks, ids),
                             ks_batched(ks, [ids, short], [50, 37, 53]), rec.min_gap(), list(ks.tie_log))
    finally:
        torch.set_num_threads(threads)


def _report(a: torch.Tensor, b: torch.Tensor, first: int = 0) -> str:
    err = (a - b).abs().amax(-1)
    bad = (err > ATOL).nonzero().flatten()
    where = f"first bad row {int(bad[0]) + first}" if bad.numel() else "all rows ok"
    return f"max |diff| {err.max().item():.3e} ({where}; scale {b.abs().max().item():.2f})"


def test_no_topk_ties(run: OracleRun) -> None:
    gap, where = run.gap
    assert gap > MIN_GAP, f"near-tie at a top-k boundary in {where}: gap {gap:.3e}"
    assert not run.ks_ties, f"kvshare saw exact top-k boundary ties: {run.ks_ties}"


def test_transformers_decode_is_self_consistent(run: OracleRun) -> None:
    assert torch.allclose(run.hf_decode, run.hf_full[PREFIX:], atol=ATOL), _report(run.hf_decode, run.hf_full[PREFIX:])


def test_prefill_matches_transformers(run: OracleRun) -> None:
    assert torch.allclose(run.ks_full, run.hf_full, atol=ATOL), _report(run.ks_full, run.hf_full)


def test_decode_matches_transformers(run: OracleRun) -> None:
    assert torch.allclose(run.ks_decode, run.hf_decode, atol=ATOL), _report(run.ks_decode, run.hf_decode, PREFIX)
    full = run.hf_full[PREFIX:]
    assert torch.allclose(run.ks_decode, full, atol=ATOL), _report(run.ks_decode, full, PREFIX)


def test_chunked_ragged_batch_matches_transformers(run: OracleRun) -> None:
    long, short = run.ks_batched
    assert torch.allclose(long, run.hf_full, atol=ATOL), _report(long, run.hf_full)
    assert torch.allclose(short, run.hf_short, atol=ATOL), _report(short, run.hf_short)
