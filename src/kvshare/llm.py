"""LLM: the offline, vLLM-style API over LLMEngine.

``LLM(model=None | name | path | Transformer, tokenizer=None, **engine_args)``; ``model=None`` is
the default shipped model "kvshare-mini-v41" (random weights from a fixed seed when no checkpoint
ships). ``generate(prompts, sampling_params, use_tqdm=True)`` accepts one prompt or a list of
prompts, each text (needs a tokenizer) or token ids, and returns one RequestOutput per prompt in
input order. A prompt the engine rejects (RequestError: empty, too long, bad params), or a request
that fails inside a step, does not stop the others: its output has ``finish_reason == "error"``
and the message in ``error``; the instance stays usable.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Sequence

from kvshare.engine.args import EngineArgs
from kvshare.engine.engine import LLMEngine
from kvshare.engine.outputs import EngineStats, RequestOutput
from kvshare.engine.sampling import SamplingParams
from kvshare.engine.sequence import RequestMetrics
from kvshare.errors import RequestError
from kvshare.tokenizer import load_tokenizer

DEFAULT_MODEL = "kvshare-mini-v41"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "EngineArgs", "LLMEngine", "DEFAULT_MODEL", "build_engine"]

Prompt = str | list[int]


def _tokenizer_for(model: Any) -> Any:
    name = model if isinstance(model, str) else DEFAULT_MODEL if model is None else None
    if name is None:
        return None
    return load_tokenizer(name)


def _normalise(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # one prompt of token ids
    return prompts


def build_engine(model: Any = None, tokenizer: Any = None, **engine_args: Any) -> LLMEngine:
    """An `LLMEngine`; with ``tensor_parallel_size > 1`` the tensor-parallel group is started first
    (`kvshare.parallel.launch.start`: workers spawned, or joined from torchrun) and the engine
    gets rank 0's shard and the group's handle."""
    args = EngineArgs(**engine_args)
    if args.tensor_parallel_size == 1:
        return LLMEngine(model, tokenizer, args=args)
    # Imported here (optional path): torch.distributed and the worker machinery load only for TP runs.
    from kvshare.parallel.launch import start

    handle, shard = start(model, args)
    return LLMEngine(shard, tokenizer, args=args, tp=handle)


class LLM:
    def __init__(self, model: Any = None, tokenizer: Any = None, **engine_args: Any) -> None:
        if tokenizer is None:
            tokenizer = _tokenizer_for(model)
        self.engine = build_engine(model if model is not None else DEFAULT_MODEL, tokenizer, **engine_args)
        self.tokenizer = tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        items = _normalise(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError(f"{len(params)} sampling params for {len(items)} prompts")
        order: list[str] = []
        results: dict[str, RequestOutput] = {}
        for prompt, p in zip(items, params):
            rid = f"gen-{next(self._ids)}"
            order.append(rid)
            try:
                self.engine.add_request(rid, prompt, p)
            except RequestError as e:
                results[rid] = _error_output(rid, prompt, str(e))
        self._run(results, len(items), use_tqdm)
        return [results[r] for r in order]

    def _run(self, results: dict[str, RequestOutput], total: int, use_tqdm: bool) -> None:
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True, initial=len(results))
        start, base = time.perf_counter(), self.engine.stats()
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                if bar is not None:
                    bar.set_postfix_str(_speed(self.engine.stats(), base, time.perf_counter() - start))
        finally:
            if bar is not None:
                bar.close()


def _speed(now: EngineStats, base: EngineStats, elapsed: float) -> str:
    dt = max(elapsed, 1e-9)
    pre = (now.prompt_tokens - base.prompt_tokens) / dt
    dec = (now.generation_tokens - base.generation_tokens) / dt
    return f"prefill {pre:,.0f} tok/s, decode {dec:,.0f} tok/s, preempted {now.num_preemptions}"


def _error_output(rid: str, prompt: Prompt, message: str) -> RequestOutput:
    text = prompt if isinstance(prompt, str) else None
    ids = list(prompt) if not isinstance(prompt, str) else []
    now = time.perf_counter()
    return RequestOutput(rid, text, ids, "", [], [], True, "error", None,
                         RequestMetrics(now, finished_time=now), error=message)
