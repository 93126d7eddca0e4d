"""The transformers peer: `DeepseekV4ForCausalLM.generate` on the same V4 weights as kvshare.

The kvshare model's ``state_dict`` (DeepSeek checkpoint names) is renamed with
``kvshare.weights.hf_naming.kvshare_to_transformers`` and loaded strictly into a transformers model
built from ``transformers_config_dict(cfg)``, so both engines compute with identical weights.

Timing uses a streamer: ``generate`` hands the prompt to ``put`` before the prefill forward and
then every new token of the batch after each step, so the gaps between calls are the prefill time
and the per-step decode times of one ordinary ``generate`` call.
"""

from __future__ import annotations

import time
import warnings
import torch

from kvshare.bench.gen import GenResult
from kvshare.bench.measure import PeakMemory, StepTimes, sync
from kvshare.config import ModelConfig


class _StepClock:
    """A `generate` streamer that only records when each `put` happens (and the tokens)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: list[float] = []
        self.puts: list[torch.Tensor] = []

    def put(self, value: torch.Tensor) -> None:
        sync(self.device)
        self.times.append(time.perf_counter())
        self.puts.append(value)

    def end(self) -> None:
        pass


def build_hf_model(cfg: ModelConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                   device: torch.device | str = "cpu") -> torch.nn.Module:
    """transformers' `DeepseekV4ForCausalLM` holding the weights in `state_dict` (kvshare names)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    from transformers.utils import logging as hf_logging

    from kvshare.weights.hf_naming import kvshare_to_transformers, transformers_config_dict

    hf_logging.set_verbosity_error()
    conf = DeepseekV4Config(**transformers_config_dict(cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = DeepseekV4ForCausalLM(conf)
    hf_sd = kvshare_to_transformers(state_dict, cfg)
    missing, unexpected = model.load_state_dict(hf_sd, strict=False)
    buffers = {n for n, _ in model.named_buffers()}
    missing = [k for k in missing if k not in buffers]
    if missing or unexpected:
        raise RuntimeError(f"weights do not map onto transformers: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.to(device=device, dtype=dtype).eval()


def hf_generate(model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int,
                device: torch.device | str = "cpu") -> GenResult:
    """One timed greedy `generate` of exactly `new_tokens` tokens per prompt (no EOS stop)."""
    dev = torch.device(device)
    ids = prompts.to(dev)
    clock = _StepClock(dev)
    with PeakMemory(dev) as mem, torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, streamer=clock,
                             pad_token_id=0, eos_token_id=None, top_k=None, top_p=None, temperature=None)
    steps = StepTimes([b - a for a, b in zip(clock.times[1:], clock.times[2:])])
    tokens = out[:, prompts.shape[1]:].tolist()
    return GenResult("transformers", prompts.shape[0], prompts.shape[1], tokens,
                     prefill_s=clock.times[1] - clock.times[0], decode=steps, memory=mem.as_dict())


def hf_warmup(model: torch.nn.Module, prompts: torch.Tensor, device: torch.device | str = "cpu") -> None:
    """A short generate so one-time costs (allocator growth, lazy init) stay out of the timed run."""
    hf_generate(model, prompts[:, : min(prompts.shape[1], 32)], 2, device)

