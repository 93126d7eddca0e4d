"""Decode speed of the shipped kvshare-mini-v41 with and without its trained DSpark drafter.

    PYTHONPATH=src python benchmarks/shipped_dspark.py [--threads 1] [--new-tokens 200]

Both engines are built once with the CLI's defaults (``LLMEngine("kvshare-mini-v41")``, plus
``speculative_config={"method": "dspark"}`` for the second); each of the README's prompts is then
generated greedily (temperature 0, no penalties: speculation drafts only for such requests),
batch 1, plain and speculative alternately so machine load hits both alike. Decode tokens/s =
(tokens - 1) / (time from the first token to the last). Mean accepted length = tokens committed
per verify step (accepted drafts + 1), from the engine's statistics. Every speculative output must
equal the plain one. Writes benchmarks/results/shipped-dspark.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from kvshare.engine.engine import LLMEngine
from kvshare.engine.sampling import SamplingParams
from kvshare.tokenizer import ByteTokenizer
from kvshare.train.eval import PROMPTS

MODEL = "kvshare-mini-v41"


def decode(eng: LLMEngine, rid: str, prompt: str, n: int) -> tuple[list[int], float, int]:
    """(tokens, decode seconds after the first token, engine steps after the first token)."""
    eng.add_request(rid, ByteTokenizer(259).encode(prompt, add_bos=True),
                    SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    toks: list[int] = []
    t_first, steps = None, 0
    with torch.inference_mode():
        while eng.has_unfinished_requests():
            for o in eng.step():
                toks = list(o.token_ids)
            if t_first is None and toks:
                t_first = time.perf_counter()
            elif t_first is not None:
                steps += 1
    return toks, time.perf_counter() - (t_first or time.perf_counter()), steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=MODEL, help="shipped name or release directory")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/shipped-dspark.json"))
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    load0 = os.getloadavg()
    plain = LLMEngine(a.model, max_num_seqs=1)
    spec = LLMEngine(a.model, max_num_seqs=1, speculative_config={"method": "dspark"})
    for eng in (plain, spec):  # warm-up (first-call allocations), not measured
        decode(eng, f"w{id(eng)}", PROMPTS[0], 16)
    rows = []
    for i, prompt in enumerate(PROMPTS):
        p_toks, p_s, p_steps = decode(plain, f"p{i}", prompt, a.new_tokens)
        before = dict(spec.stats().extra)
        s_toks, s_s, s_steps = decode(spec, f"s{i}", prompt, a.new_tokens)
        after = dict(spec.stats().extra)
        verifies = after["spec_num_verifies"] - before.get("spec_num_verifies", 0)
        accepted = after["spec_accepted_tokens"] - before.get("spec_accepted_tokens", 0)
        rows.append({"prompt": prompt, "plain_tok_s": (len(p_toks) - 1) / p_s, "spec_tok_s": (len(s_toks) - 1) / s_s,
                     "plain_step_ms": 1e3 * p_s / p_steps, "spec_step_ms": 1e3 * s_s / s_steps,
                     "mean_accepted_length": 1 + accepted / verifies, "lossless": s_toks == p_toks})
    n = len(rows)
    total = {k: sum(r[k] for r in rows) / n for k in ("plain_tok_s", "spec_tok_s", "plain_step_ms", "spec_step_ms",
                                                      "mean_accepted_length")}
    total["speedup"] = total["spec_tok_s"] / total["plain_tok_s"]
    total["lossless"] = all(r["lossless"] for r in rows)
    out = {"model": a.model, "threads": a.threads, "new_tokens": a.new_tokens, "torch": torch.__version__,
           "loadavg_before": load0, "loadavg_after": os.getloadavg(), "rows": rows, "mean": total}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print("| prompt | plain tok/s | DSpark tok/s | plain step ms | verify step ms | mean accepted length | lossless |")
    print("|---|---|---|---|---|---|---|")
    for r in rows + [dict(total, prompt="mean")]:
        print(f"| {r['prompt']!r} | {r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} | {r['plain_step_ms']:.1f} | "
              f"{r['spec_step_ms']:.1f} | {r['mean_accepted_length']:.2f} | {r['lossless']} |")
    print(f"speed-up {total['speedup']:.2f}x; load average before {load0}, after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
