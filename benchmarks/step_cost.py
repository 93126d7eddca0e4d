"""Torch calls and host syncs of one decode step, and decode tok/s, of whichever kvshare is imported.

Compares two trees side by side (before / after a change) when run once per tree::

    PYTHONPATH=/path/to/tree/src python benchmarks/step_cost.py calls        # shipped model, batch 4
    PYTHONPATH=/path/to/tree/src python benchmarks/step_cost.py decode       # bench peer V4, batch 1 and 8

``calls`` counts with the suite's `CallCounter` (tests/torch_calls.py: a TorchFunctionMode; attribute
reads such as ``.shape`` count as calls, as they cost a Python dispatch) around ``engine.step()`` of
the shipped kvshare-mini-v41 decoding 4 sequences, in the default mode and with batch invariance off.
``decode`` times the bench's peer V4 model (bf16, `kvshare bench peer` sizes) at 1 thread. Each
prints one JSON line; alternate the trees and keep the best of several runs for timings.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import kvshare


def calls() -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from torch_calls import CallCounter

    from kvshare.engine.sampling import SamplingParams
    from kvshare.llm import LLM

    out: dict = {}
    for invariant in (True, False):
        eng = LLM("kvshare-mini-v41", batch_invariant=invariant).engine
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        for i in range(4):
            eng.add_request(str(i), list(range(3 + i, 80 + 2 * i)), params)
        for _ in range(3):
            eng.step()  # prefill, first decodes
        steps = []
        for _ in range(3):
            with CallCounter() as c:
                eng.step()
            steps.append({"calls": c.calls, "syncs": c.syncs, "sync_sites": dict(c.sites)})
        out["invariant" if invariant else "batched"] = steps
    return out


def decode(new_tokens: int = 32) -> dict:
    from kvshare.bench.gen import equal_length_prompts
    from kvshare.bench.kv_runner import DTYPES, build_model, kv_run
    from kvshare.bench.sizes import BenchSizes, peer_v4_config
    from kvshare.config import ModelConfig

    s = BenchSizes()
    model = build_model(ModelConfig.from_dict(peer_v4_config(s)), s.seed, DTYPES["bfloat16"], "cpu")
    out: dict = {}
    for b in (1, 8):
        prompts = equal_length_prompts(b, s.prompt_len, s.vocab, s.seed + b)
        res, _ = kv_run(model, prompts, new_tokens, block_size=s.block_size, dtype="bfloat16", device="cpu")
        out[str(b)] = {"decode_tok_s": res.decode_tps, "prefill_tok_s": res.prefill_tps, "tokens": res.tokens}
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    what = sys.argv[1] if len(sys.argv) > 1 else "calls"
    result = calls() if what == "calls" else decode()
    print(json.dumps({"tree": kvshare.__file__, what: result}))
