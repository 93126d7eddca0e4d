"""The shipped kvshare-mini-v41 with its shipped sampling defaults does not fall into character loops.

Target of issue 17: greedy output (temperature 0 with the model's generation_config.json penalties)
for the README's prompts has no run of more than 8 identical characters in 200 tokens.

Checked in float64, where the greedy tokens do not depend on the CPU (its matmul noise, ~1e-16, is
far below the model's top-2 logit gaps): measured longest runs 8, 8, 8, 8. Greedy text in bf16 or
fp32 depends on the CPU's rounding (issue 24): on an AMX Xeon bf16 gave 4, 4, 8, 8 and fp32 gave a
26-character `#` banner for "import "; under ``ATEN_CPU_CAPABILITY=avx2`` bf16 gave runs of 31 and 27.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kvshare.engine.generation_config import generation_defaults
from kvshare.shipped import shipped_model_dir
from kvshare.train.eval import PROMPTS, default_params

MODEL = "kvshare-mini-v41"


def longest_run(text: str) -> int:
    return max((len(list(g)) for _, g in itertools.groupby(text)), default=0)


def test_longest_run_counts_identical_neighbours():
    assert [longest_run(s) for s in ("", "a", "abba", "x____y", "   ")] == [0, 1, 2, 4, 3]


@pytest.mark.skipif(shipped_model_dir(MODEL) is None, reason="no shipped weights")
def test_greedy_with_shipped_defaults_has_no_long_character_runs():
    from kvshare import LLM
    from kvshare.weights.loader import load_model
    from kvshare.tokenizer import ByteTokenizer

    defaults = generation_defaults(MODEL)
    assert defaults.get("repetition_penalty", 1.0) != 1.0 or defaults.get("frequency_penalty", 0.0) != 0.0
    model = load_model(MODEL, quant=True, dtype=torch.float64)
    llm = LLM(model, tokenizer=ByteTokenizer(model.cfg.vocab_size), max_num_seqs=len(PROMPTS))
    params = default_params(MODEL, 200, greedy=True)
    params.ignore_eos = True  # always 200 tokens
    with torch.inference_mode():
        outs = llm.generate(list(PROMPTS), params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert len(out.token_ids) == 200
        assert longest_run(prompt + out.text) <= 8, (prompt, out.text)
