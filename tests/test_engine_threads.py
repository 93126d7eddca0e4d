"""EngineArgs.threads: one default for the CLI, LLM() and the server, resolved by the engine."""

from __future__ import annotations

import pytest
import torch

from kvshare.engine.args import resolve_threads
from kvshare.engine.engine import LLMEngine
from test_model_common import make_model


def test_small_cpu_models_default_to_one_thread_and_an_explicit_count_wins() -> None:
    model = make_model("tiny-v41")
    assert resolve_threads(None, model) == 1
    assert resolve_threads(3, model) == 3
    with pytest.raises(ValueError, match="threads"):
        resolve_threads(0, model)


def test_the_engine_applies_its_threads_argument() -> None:
    before = torch.get_num_threads()
    try:
        eng = LLMEngine(make_model("tiny-v41"), threads=2, max_num_seqs=1, num_blocks=8, max_model_len=64)
        assert eng.threads == 2 == torch.get_num_threads()
        eng = LLMEngine(make_model("tiny-v41"), max_num_seqs=1, num_blocks=8, max_model_len=64)
        assert eng.threads == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
