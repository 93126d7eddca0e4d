"""The cost of batch invariance: the same engine with `batch_invariant` off and on, side by side.

Models: the peer benchmark's V4 model (kvshare bench peer's config, seeded random weights, bf16) and
the shipped kvshare-mini-v41 (bf16). Per model and mode: prefill tok/s of 8 x 256-token prompts in
one step, decode tok/s at batch 1 and 8 (32 new tokens, greedy); the two modes alternate and each
keeps its best of `--repeats` runs. One intra-op thread. Also reports whether greedy tokens of each
batch-8 run equal each prompt's alone run (they must with batch_invariant on).

    PYTHONPATH=src python benchmarks/batch_invariance.py [--repeats 2] [--out benchmarks/results/batch-invariance.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvshare.bench.kv_runner import build_model, kv_generate
from kvshare.bench.sizes import BenchSizes, peer_v4_config
from kvshare.config import ModelConfig
from kvshare.llm import LLM
from kvshare.weights.loader import load_model

PROMPT, NEW, BATCHES = 256, 32, (1, 8)


def _prompts(vocab: int, batch: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - 1, (batch, PROMPT), generator=g)


def measure(model: torch.nn.Module, vocab: int, invariant: bool) -> dict:
    row: dict = {}
    for b in BATCHES:
        prompts = _prompts(vocab, b, 7 + b)
        llm = LLM(model, max_num_seqs=b, max_num_batched_tokens=b * PROMPT, batch_invariant=invariant,
                  enable_prefix_caching=False)
        kv_generate(llm.engine, prompts, 2, tag="w")  # warm-up
        res = kv_generate(llm.engine, prompts, NEW)
        row[f"prefill_tps_b{b}"] = res.prefill_tps
        row[f"decode_tps_b{b}"] = res.decode_tps  # batch / median decode step
        if b > 1:
            alone = LLM(model, max_num_seqs=1, batch_invariant=invariant, enable_prefix_caching=False)
            row["batched_equals_alone"] = sum(kv_generate(alone.engine, p[None], NEW).tokens[0] == t
                                              for p, t in zip(prompts, res.tokens))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    s = BenchSizes()
    cfg = ModelConfig.from_dict(peer_v4_config(s))
    models = {"peer-v4-bf16": (build_model(cfg, s.seed, torch.bfloat16, "cpu"), cfg.vocab_size),
              "kvshare-mini-v41-bf16": (load_model("kvshare-mini-v41", dtype=torch.bfloat16), 259)}
    report: dict = {}
    for name, (model, vocab) in models.items():
        best: dict[bool, dict] = {}
        for _ in range(args.repeats):
            for inv in (False, True):
                r = measure(model, vocab, inv)
                prev = best.get(inv)
                best[inv] = r if prev is None else {k: max(v, prev[k]) for k, v in r.items()}
        report[name] = {"off": best[False], "on": best[True],
                        "on/off": {k: best[True][k] / best[False][k] for k in best[True] if "tps" in k}}
        print(name, json.dumps(report[name], indent=1), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
