"""kvshare's side of every benchmark: a model with seeded random weights, a paged `LLMEngine`
sized for the run, and step-by-step timing of a greedy generation.

``kv_generate`` adds every prompt, then calls ``engine.step()`` until all requests finish. Steps
until every request has its first token are the prefill (the engine is given enough batched
tokens to prefill all prompts in one step); every later step is one decode step of the batch.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvshare.bench.gen import GenResult
from kvshare.bench.measure import PeakMemory, StepTimes, now
from kvshare.config import ModelConfig
from kvshare.topology import Topology

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_model(cfg: ModelConfig, seed: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                share_kv_cache: bool = True) -> torch.nn.Module:
    """kvshare's `Transformer` with deterministic random weights and quantisation off."""
    from kvshare.model.deepseek import Transformer

    topo = Topology(cfg, share_cache=share_kv_cache)
    from kvshare.model.dtypes import cast_model

    model = Transformer(cfg, topo, quant=False).init_weights(seed)
    return cast_model(model, dtype, device).eval()


def blocks_needed(batch: int, max_len: int, block_size: int) -> int:
    """Blocks for `batch` sequences of `max_len` tokens, plus the null block."""
    return batch * math.ceil(max_len / block_size) + 1


def make_engine(model: torch.nn.Module, *, batch: int, max_len: int, block_size: int, dtype: str,
                device: str, share_kv_cache: bool = True, num_blocks: int | None = None,
                memory_bytes: int | None = None, max_batched_tokens: int | None = None,
                enable_prefix_caching: bool = True, quantize: bool = False, threads: int | None = None) -> Any:
    """An `LLMEngine` over `model` sized for `batch` sequences of `max_len`; quantisation off unless
    `quantize` (the release's FP8 activations and cache formats); `threads`: the engine's
    `EngineArgs.threads` (None: its default, one thread for a model under 100M parameters)."""
    try:
        from kvshare.llm import LLMEngine
    except ImportError:
        from kvshare.engine.engine import LLMEngine

    kw: dict[str, Any] = dict(
        block_size=block_size, max_num_seqs=batch, max_model_len=max_len,
        max_num_batched_tokens=max_batched_tokens or batch * max_len, dtype=dtype, device=device,
        share_kv_cache=share_kv_cache, quantize=quantize, enable_prefix_caching=enable_prefix_caching,
        threads=threads)
    if memory_bytes is not None:
        kw["gpu_memory_bytes"] = memory_bytes
    else:
        kw["num_blocks"] = num_blocks or blocks_needed(batch, max_len, block_size)
    return LLMEngine(model, **kw)


def greedy(new_tokens: int) -> Any:
    """Greedy sampling of exactly `new_tokens` tokens (EOS ignored)."""
    from kvshare.engine.sampling import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)


def kv_generate(engine: Any, prompts: torch.Tensor, new_tokens: int, device: str = "cpu",
                tag: str = "r") -> GenResult:
    """One timed greedy generation through `engine` (see module docstring)."""
    batch, length = prompts.shape
    params = greedy(new_tokens)
    ids = [f"{tag}{i}" for i in range(batch)]
    tokens: dict[str, list[int]] = {}
    decode = StepTimes()
    prefill_s = float("nan")
    t_start = now(device)
    for rid, p in zip(ids, prompts.tolist()):
        engine.add_request(rid, p, params)
    started: set[str] = set()
    while engine.has_unfinished_requests():
        t0 = now(device)
        outs = engine.step()
        t1 = now(device)
        in_prefill = len(started) < batch
        for o in outs:
            tokens[o.request_id] = list(o.token_ids)
            if o.token_ids:
                started.add(o.request_id)
        if in_prefill:
            if len(started) == batch:
                prefill_s = t1 - t_start
        elif outs:
            decode.add(t1 - t0)
    return GenResult("kvshare", batch, length, [tokens.get(r, []) for r in ids], prefill_s, decode)


def kv_prefill(engine: Any, prompts: torch.Tensor, new_tokens: int, device: str = "cpu",
               tag: str = "p") -> float:
    """Add the prompts and step until every request has its first token; returns the seconds."""
    params = greedy(new_tokens)
    ids = {f"{tag}{i}" for i in range(prompts.shape[0])}
    t0 = now(device)
    for i, p in enumerate(prompts.tolist()):
        engine.add_request(f"{tag}{i}", p, params)
    started: set[str] = set()
    while len(started) < len(ids) and engine.has_unfinished_requests():
        started.update(o.request_id for o in engine.step() if o.token_ids and o.request_id in ids)
    return now(device) - t0


def kv_decode_interleaved(engines: list[Any], steps: int, device: str = "cpu") -> list[StepTimes]:
    """Time `steps` decode steps of every engine, one step of each in turn, then finish them.

    Interleaving spreads a shared machine's load changes over all engines alike, so their step
    times compare even when the load drifts during the measurement.
    """
    times = [StepTimes() for _ in engines]
    for _ in range(steps):
        for e, t in zip(engines, times):
            if e.has_unfinished_requests():
                t0 = now(device)
                outs = e.step()
                dt = now(device) - t0
                if outs:
                    t.add(dt)
    for e in engines:
        while e.has_unfinished_requests():
            e.step()
    return times


def kv_run(model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int, *, block_size: int,
           dtype: str, device: str, warmup: bool = True) -> tuple[GenResult, Any]:
    """Build an engine for this batch, warm it up, time one generation; memory covers engine + run."""
    batch, length = prompts.shape
    if warmup:
        eng = make_engine(model, batch=batch, max_len=length + new_tokens, block_size=block_size,
                          dtype=dtype, device=device)
        kv_generate(eng, prompts, 2, device, tag="w")
        del eng
    with PeakMemory(device) as mem:
        engine = make_engine(model, batch=batch, max_len=length + new_tokens, block_size=block_size,
                             dtype=dtype, device=device)
        res = kv_generate(engine, prompts, new_tokens, device)
    res.memory = mem.as_dict()
    return res, engine


def engine_layout(engine: Any) -> Any:
    """The `CacheLayout` the engine's block pool was built from."""
    for path in ("layout", "pool.layout", "cache.layout", "backend.pool.layout"):
        obj: Any = engine
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        return obj
    raise AttributeError("the engine exposes no CacheLayout (looked for engine.layout / engine.pool.layout)")
