"""LLM: the offline, vLLM-style API over LLMEngine.

``LLM(model=None | name | path | Transformer, tokenizer=None, **engine_args)``; ``model=None`` is
the default shipped model "kvshare-mini-v41" (random weights from a fixed seed when no checkpoint
ships).

``generate(prompts, sampling_params, use_tqdm=True)`` accepts one prompt or a list of prompts, each
text (needs a tokenizer), token ids, or vLLM's dicts ``{"prompt": text}`` / ``{"prompt_token_ids":
[...]}``, and returns one `RequestOutput` per prompt in input order, shaped as vLLM's:
``out.outputs[i].text`` / ``.token_ids`` / ``.logprobs`` / ``.finish_reason`` for the i-th of
``SamplingParams(n=...)`` sequences (sequence i samples with ``seed + i`` when a seed is given, as
the server does), ``out.prompt_token_ids``. ``out.text`` / ``out.token_ids`` (the first sequence's)
still work for code written against the earlier API; new code reads ``outputs[0]``.
``chat(messages, ...)`` renders a conversation (or a list of them) with the model's chat template
and generates from it.

A prompt the engine rejects (RequestError: empty, too long, bad params), or a request that fails
inside a step, does not stop the others: its output has ``finish_reason == "error"`` and the
message in ``error``; the instance stays usable.

Lifetime: ``shutdown()`` (or leaving a ``with LLM(...) as llm:`` block) stops the engine's
tensor-parallel workers and leaves the process group, so another tensor-parallel `LLM` can start in
the same process; an `LLM` that is garbage-collected without it does the same (a finalizer), and
the interpreter's exit does it for any still open. A shut-down `LLM` refuses further calls.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import weakref
from typing import Any, Sequence

from kvshare.engine.args import EngineArgs
from kvshare.engine.engine import LLMEngine
from kvshare.engine.outputs import CompletionOutput, EngineStats, Logprob, RequestOutput
from kvshare.engine.sampling import SamplingParams
from kvshare.engine.sequence import RequestMetrics
from kvshare.errors import RequestError
from kvshare.tokenizer import load_tokenizer

DEFAULT_MODEL = "kvshare-mini-v41"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "EngineArgs", "LLMEngine",
           "DEFAULT_MODEL", "build_engine"]

Prompt = str | list[int] | dict[str, Any]


def _tokenizer_for(model: Any) -> Any:
    name = model if isinstance(model, str) else DEFAULT_MODEL if model is None else None
    if name is None:
        return None
    return load_tokenizer(name)


def _is_ids(p: Any) -> bool:
    return isinstance(p, list) and bool(p) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)


def _normalise(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)) or _is_ids(prompts):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]


def _engine_prompt(prompt: Prompt) -> str | list[int]:
    """What the engine takes for one prompt: text or token ids (vLLM's dict forms unwrapped)."""
    if isinstance(prompt, dict):
        if set(prompt) == {"prompt_token_ids"}:
            return list(prompt["prompt_token_ids"])
        if set(prompt) == {"prompt"}:
            return prompt["prompt"]
        raise RequestError(f"a prompt dict is {{'prompt': text}} or {{'prompt_token_ids': [...]}}, got keys "
                           f"{sorted(prompt)}")
    return prompt


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
    """The offline API (module doc)."""

    def __init__(self, model: Any = None, tokenizer: Any = None, **engine_args: Any) -> None:
        if tokenizer is None:
            tokenizer = _tokenizer_for(model)
        self.engine = build_engine(model if model is not None else DEFAULT_MODEL, tokenizer, **engine_args)
        self.tokenizer = tokenizer
        self._ids = itertools.count()
        self._finalizer = weakref.finalize(self, LLMEngine.shutdown, self.engine)

    # ---- lifetime --------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and leave the process group (idempotent)."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        """Whether `shutdown` ran."""
        return not self._finalizer.alive

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this LLM is shut down; create a new one")

    # ---- generation ------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order, each with `n` sequences in `outputs` (module doc)."""
        self._check_open()
        items = _normalise(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError(f"{len(params)} sampling params for {len(items)} prompts")
        groups: list[list[str]] = []
        results: dict[str, RequestOutput] = {}
        for prompt, p in zip(items, params):
            rids = []
            for i in range(p.n if isinstance(p.n, int) and p.n >= 1 else 1):
                rid = f"gen-{next(self._ids)}"
                rids.append(rid)
                try:
                    self.engine.add_request(rid, _engine_prompt(prompt), _sequence_params(p, i))
                except RequestError as e:
                    results[rid] = _error_output(rid, prompt, str(e))
            groups.append(rids)
        self._run(results, sum(len(g) for g in groups), use_tqdm)
        return [self._grouped([results[r] for r in rids]) for rids in groups]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {role, content} messages) or a list of them,
        rendered with the model's chat template (`tools` as the server renders them;
        `chat_template_kwargs` may set ``thinking``). One RequestOutput per conversation."""
        self._check_open()
        if self.tokenizer is None:
            raise ValueError("LLM.chat needs a tokenizer")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        extra: dict[str, Any] = {}
        if tools:
            from kvshare.server.tool_calls import DSML_FORMAT

            extra.update(tools=tools, tool_format=DSML_FORMAT)
        kw = chat_template_kwargs or {}
        if kw.get("thinking", kw.get("enable_thinking", False)):
            extra["thinking"] = True
        prompts: list[Prompt] = [{"prompt_token_ids": list(self.tokenizer.apply_chat_template(
            list(c), add_generation_prompt=add_generation_prompt, **extra))} for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _grouped(self, outs: list[RequestOutput]) -> RequestOutput:
        """The first sequence's RequestOutput carrying all of the prompt's sequences in `outputs`."""
        tok = self.tokenizer
        decode = (lambda t: tok.decode([t], skip_special_tokens=False)) if tok is not None else None
        first = outs[0]
        first.outputs = [o.completion(i, decode) for i, o in enumerate(outs)]
        return first

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


def _sequence_params(p: SamplingParams, i: int) -> SamplingParams:
    """Sequence i of a prompt: one engine request (n = 1) sampling with seed + i."""
    if not isinstance(p, SamplingParams) or (p.n == 1 and i == 0):
        return p
    seed = p.seed + i if p.seed is not None and isinstance(p.seed, int) else p.seed
    return dataclasses.replace(p, n=1, seed=seed)


def _speed(now: EngineStats, base: EngineStats, elapsed: float) -> str:
    dt = max(elapsed, 1e-9)
    pre = (now.prompt_tokens - base.prompt_tokens) / dt
    dec = (now.generation_tokens - base.generation_tokens) / dt
    return f"prefill {pre:,.0f} tok/s, decode {dec:,.0f} tok/s, preempted {now.num_preemptions}"


def _error_output(rid: str, prompt: Prompt, message: str) -> RequestOutput:
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt", prompt.get("prompt_token_ids", ""))
    text = prompt if isinstance(prompt, str) else None
    ids = list(prompt) if isinstance(prompt, list) else []
    now = time.perf_counter()
    return RequestOutput(rid, text, ids, "", [], [], True, "error", None,
                         RequestMetrics(now, finished_time=now), error=message)
