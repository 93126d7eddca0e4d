"""LLMEngine: requests in, one scheduler step at a time, RequestOutputs out.

``step()`` is one pipeline: the Scheduler emits a StepPlan (continuous batching, chunked prefill,
preemption); per isolation group the Proposer adds drafts (speculation; none otherwise), the
Executor runs the forward (the only caller of the model runner and the backend's end of step;
tensor parallelism replaces it with one that replays each operation on the workers) and the
Acceptor turns the logits rows into committed tokens (Sampler, or speculative verification);
then one commit advances every sequence by its committed tokens (blocks past them freed, prefix
caching told) and appends the new tokens (stop checks, detokenisation); the step returns the
outputs of the requests that got a token or finished.

Invariants: a request that fails validation raises RequestError from ``add_request`` and leaves
the engine untouched; a finished or aborted request holds no blocks and no slot. A request that
fails inside a step (forward, sampling or bookkeeping) finishes alone with finish_reason "error";
the others continue with unchanged outputs (``isolation``), and the engine stays usable.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, Callable, Protocol

import torch

from kvshare.cache.blocks import BlockManager
from kvshare.cache.paged_backend import PagedBackend
from kvshare.cache.pool import BlockPool
from kvshare.engine.args import (EngineArgs, apply_threads, resolve_batch_invariant, resolve_device, resolve_dtype,
                                 resolve_kernels)
from kvshare.engine.cache_plan import cache_plan
from kvshare.engine.acceptor import Acceptance, Accepted, Acceptor
from kvshare.engine.executor import Executor
from kvshare.engine.isolation import run_isolated
from kvshare.engine.logprobs import record_prompt_logprobs, sampled_top_logprobs
from kvshare.engine.structured import StructuredOutputs
from kvshare.engine.model_runner import ModelRunner
from kvshare.engine.outputs import EngineStats, RequestOutput
from kvshare.engine.prefix_caching import NoPrefixCaching, PrefixCaching
from kvshare.engine.sampling import Sampler, SamplingParams
from kvshare.engine.scheduler import Scheduler
from kvshare.engine.sequence import Sequence, SequenceStatus
from kvshare.engine.spec_config import SpeculativeConfig
from kvshare.engine.speculative import NoProposer, Speculator
from kvshare.engine.step_plan import ScheduledChunk
from kvshare.errors import RequestError, SetupError
from kvshare.model.dspark import DSparkDraft
from kvshare.model.dtypes import cast_model, weight_bytes
from kvshare.layers.linear import pack_linears
from kvshare.weights.loader import load_model
from kvshare.topology import Topology


class TensorParallel(Protocol):
    """Rank 0's handle on a started tensor-parallel group (kvshare.parallel.launch.TPHandle)."""

    def executor(self, runner: ModelRunner, pool: BlockPool, draft: Any, windows: Any) -> Executor: ...

    def close(self) -> None: ...


class LLMEngine:
    def __init__(self, model: Any = None, tokenizer: Any = None, args: EngineArgs | None = None,
                 tp: TensorParallel | None = None, **engine_args: Any) -> None:
        """`tp`: rank 0's handle when the group was started above the engine (`kvshare.llm.build_engine`
        starts it and passes rank 0's shard as `model`); the engine then runs every operation through
        the group's executor. ``tensor_parallel_size > 1`` without a handle is refused."""
        self.args = args = dataclasses.replace(args or EngineArgs(), **engine_args)
        self.tp = tp
        if args.tensor_parallel_size != 1 and tp is None:
            raise SetupError(f"tensor_parallel_size {args.tensor_parallel_size} needs the group started first: "
                             "build the engine with kvshare.llm.build_engine (or LLM), which starts it")
        model = self._load(model, args)
        self.batch_invariant = resolve_batch_invariant(args.batch_invariant, self.device, self.dtype)
        model.bind(resolve_kernels(args, self.batch_invariant, self.device, self.dtype))
        self.threads = apply_threads(args.threads, model)
        self.weight_bytes = weight_bytes(model)  # as stored (bf16 with the fp32 set, or the oracle dtype)
        self.cfg = model.cfg
        self.tokenizer = tokenizer
        q = getattr(model, "quant", None)
        cache_q = bool(q.cache) if q is not None else bool(args.quantize)
        index_q = bool(q.index) if q is not None else bool(args.quantize)
        topo = getattr(model, "topo", None) or Topology(self.cfg)  # the model's own wiring
        self.plan = cache_plan(self.cfg, topo, args, cache_q, index_q, self.dtype)
        self.layout, num_blocks, self.max_model_len = self.plan.layout, self.plan.num_blocks, self.plan.max_model_len
        slots = self.plan.num_slots
        self.pool = BlockPool(self.layout, num_blocks, slots, self.device, self.dtype)
        self.backend = PagedBackend(self.pool)
        self.blocks = BlockManager(num_blocks, self.layout.block_size, slots, self.max_model_len, self.device)
        self.runner = ModelRunner(model, self.backend, self.blocks, self.device)
        spec = SpeculativeConfig.parse(args.speculative_config)
        draft = DSparkDraft(model) if spec is not None else None
        windows = draft.windows(self.backend) if draft is not None else None
        self.executor: Executor = (self.tp.executor(self.runner, self.pool, draft, windows) if self.tp is not None
                                   else Executor(self.runner, self.pool, draft, windows))
        self.blocks.on_open = self.executor.reset_slot  # a recycled slot starts with zeroed rings (§9.6)
        self.prefix_caching: PrefixCaching | NoPrefixCaching = NoPrefixCaching()
        if args.enable_prefix_caching:
            self.prefix_caching = PrefixCaching(self.layout, self.pool, self.blocks, self.backend,
                                        self.plan.checkpoint_budget,
                                        str(getattr(model, "name_or_path", "")), self.dtype, self.executor.restore)
            self.executor.observers.append(self.prefix_caching)
        self.scheduler = Scheduler(self.blocks, slots, args.max_num_batched_tokens, args.chunked_prefill,
                                   self.prefix_caching)
        self.scheduler.prefill_tokens_with_decodes = args.prefill_tokens_with_decodes
        sampler = Sampler(self.device, args.seed or 0)
        eos = set(self.cfg.eos_token_ids)
        if tokenizer is not None:
            eos |= set(getattr(tokenizer, "eos_token_ids", None) or [])
        self.eos_ids = frozenset(i for i in eos if i is not None)
        sampler.eos_ids = self.eos_ids
        self.structured = StructuredOutputs(tokenizer, self.cfg.vocab_size, self.eos_ids)
        sampler.masks_for = self.structured.masks
        self.runner.on_prompt_rows = record_prompt_logprobs
        self.requests: dict[str, Sequence] = {}
        self._aborted: list[Sequence] = []
        self._suspects: set[str] = set()  # request ids whose chunks run alone (see isolation)
        self._order = itertools.count()
        self._stats = EngineStats(num_blocks_total=self.blocks.allocator.num_usable,
                                  bytes_per_block=self.layout.bytes_per_block)
        self.speculator: Speculator | None = None
        self.proposer: Speculator | NoProposer = NoProposer()
        if spec is not None:
            self.speculator = self.proposer = Speculator(self.executor, sampler, spec, self.blocks,
                                                         self.max_model_len, self._stats.extra, self.structured)
        self.acceptor = Acceptor(sampler, self.speculator)

    @property
    def sampler(self) -> Sampler:
        """The sampler every committed token comes from (the acceptor's and the verifier's)."""
        return self.acceptor.sampler

    @sampler.setter
    def sampler(self, sampler: Sampler) -> None:
        """Swap the sampler everywhere it is held (acceptor and speculator)."""
        self.acceptor.sampler = sampler
        if self.speculator is not None:
            self.speculator.sampler = sampler

    @property
    def model(self) -> Any:
        """The target model (the runner's: assigning it swaps what every forward runs)."""
        return self.runner.model

    @model.setter
    def model(self, model: Any) -> None:
        self.runner.model = model

    @property
    def prefix(self) -> PrefixCaching | None:
        """The prefix cache's engine side, None when prefix caching is off."""
        p = self.prefix_caching
        return p if isinstance(p, PrefixCaching) else None

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at interpreter exit)."""
        if self.tp is not None:
            self.tp.close()

    def _load(self, model: Any, args: EngineArgs) -> Any:
        if model is None or isinstance(model, str):
            self.device = resolve_device(args.device)
            self.dtype = resolve_dtype(args.dtype, self.device)
            quant = True if args.quantize is None else args.quantize
            return load_model(model or "kvshare-mini-v41", dtype=self.dtype, device=self.device, quant=quant,
                              engram_table=args.engram_table,
                              draft=args.speculative_config is not None)
        p = next(model.parameters())
        self.device = resolve_device(args.device) if args.device is not None else p.device
        self.dtype = resolve_dtype(args.dtype, self.device) if args.dtype is not None else p.dtype
        if (p.device, p.dtype) != (self.device, self.dtype):
            model = cast_model(model, self.dtype, self.device)
        else:
            pack_linears(model)
        if args.quantize is not None and hasattr(model, "set_quant"):
            model.set_quant(args.quantize)
        return model.eval()

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    cache_salt: str | None = None) -> None:
        """Queue a request; RequestError (this request only) on a bad prompt or bad params.

        `cache_salt`: requests share cached prefix blocks only when their salts are equal."""
        if request_id in self.requests:
            raise RequestError(f"request {request_id!r}: id already in use")
        params = dataclasses.replace(params) if params is not None else SamplingParams()
        params.stop = list(params.stop) if not isinstance(params.stop, str) else [params.stop]
        try:
            params.validate(self.cfg.vocab_size)
        except RequestError as e:
            raise RequestError(f"request {request_id!r}: {e}") from None
        if params.n != 1:  # one sequence per engine request; LLM.generate and the server run n of them
            raise RequestError(f"request {request_id!r}: invalid sampling params: n: an engine request samples one "
                               "sequence (n = 1); LLM.generate runs n requests")
        text = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"request {request_id!r}: a text prompt needs a tokenizer; pass token ids")
            text = prompt
            ids = list(self.tokenizer.encode(prompt, add_bos=True))
        else:
            ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.cfg.vocab_size for t in ids):
                raise RequestError(f"request {request_id!r}: prompt token ids must be integers in "
                                   f"[0, {self.cfg.vocab_size})")
        if not ids:
            raise RequestError(f"request {request_id!r}: the prompt is empty")
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens:]
        if params.prompt_logprobs is not None and self.speculator is not None:
            raise RequestError(f"request {request_id!r}: invalid sampling params: prompt_logprobs is not available "
                               "with speculative decoding")
        if len(ids) > self.max_model_len:
            raise RequestError(f"request {request_id!r}: prompt has {len(ids)} tokens, more than max_model_len "
                               f"{self.max_model_len}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise RequestError(f"request {request_id!r}: cache_salt must be a string")
        if params.structured is not None:
            try:
                self.structured.add(request_id, params.structured)
            except RequestError as e:
                raise RequestError(f"request {request_id!r}: {e}") from None
        seq = Sequence(request_id, text, ids, params, next(self._order))
        seq.cache_salt = cache_salt
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs, seq.prompt_top_logprobs = [None] * len(ids), [None] * len(ids)
        if self.tokenizer is not None and hasattr(self.tokenizer, "incremental_decoder"):
            seq.detok = self.tokenizer.incremental_decoder()
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks; its final output (reason "abort") comes with the next step."""
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            self._retire(seq)
            self._aborted.append(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = [RequestOutput.of(s) for s in self._aborted]
        self._aborted.clear()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return outputs
        budget = [self.scheduler.max_num_batched_tokens - plan.num_tokens]  # what drafts may spend
        run = run_isolated(lambda group: self._run_group(group, budget), plan.chunks, self._suspects)
        for seq, err in run.failed:
            self._fail(seq, err, outputs)
        for seq in run.requeue:
            self.scheduler.requeue(seq)
        chunks: list[ScheduledChunk] = []
        committed: list[int] = []
        accepted: Acceptance = {}
        for group, (n, acc) in run.done:
            accepted.update({len(chunks) + i: a for i, a in acc.items()})
            chunks += group
            committed += n
        self._commit(chunks, committed, accepted, outputs)
        return outputs

    def _run_group(self, group: list[ScheduledChunk], budget: list[int]) -> tuple[list[int], Acceptance]:
        """Propose, forward, accept for one isolation group: (committed tokens per chunk, acceptance)."""
        self.proposer.propose(group, budget)
        fwd = self.executor.forward(group, self.proposer.taps)
        accepted = self.acceptor.accept(fwd)
        committed = [c.length + (len(a.tokens) - 1 if c.draft and isinstance(a, Accepted) else 0)
                     for c, a in ((c, accepted.get(i)) for i, c in enumerate(group))]
        self.proposer.after_accept(committed)
        return committed, accepted

    def _commit(self, chunks: list[ScheduledChunk], committed: list[int], accepted: Acceptance,
                outputs: list[RequestOutput]) -> None:
        """Advance every chunk's sequence by its committed tokens (blocks past them freed), tell
        prefix caching and the commit hooks, then append the new tokens in chunk order."""
        drafted = False
        for c, n in zip(chunks, committed):
            c.seq.num_computed += n
            c.seq.new_token_ids = []
            if c.draft:  # only a drafted chunk holds blocks past its committed tokens
                drafted = True
                self.blocks.shrink(c.seq.slot, c.seq.num_computed)  # type: ignore[arg-type]
        # Before the appends (a request finishing below checkpoints at release); a boundary inside
        # accepted drafts waits for the call after them.
        self.prefix_caching.on_commit(chunks, final=not drafted)
        for hook in self.proposer.on_commit:
            hook([c.seq for c in chunks], committed)
        self._stats.num_steps += 1
        self._stats.prompt_tokens += sum(c.length for c in chunks if not c.is_decode)
        now = time.perf_counter()
        for i in sorted(accepted):
            seq, a = chunks[i].seq, accepted[i]
            if isinstance(a, BaseException):
                self._fail(seq, a, outputs)
                continue
            self.proposer.observe(seq, a)
            self._emit(seq, a.tokens, a.logprobs, now, outputs, lambda a=a: a.token_rows)
        if drafted:
            self.prefix_caching.on_commit(chunks)  # accepted drafts are token ids now: their blocks and boundaries

    def _emit(self, seq: Sequence, tokens: list[int], logprobs: list[float], now: float,
              outputs: list[RequestOutput], rows: Callable[[], torch.Tensor] | None = None) -> None:
        """Append a request's new tokens in order (stopping at the first that finishes it), record
        its first-token time and report it. A failure here (say a detokeniser error) fails this
        request only. `rows`: the raw logits behind each token (read only for top-k logprobs). A
        request with max_tokens 0 finishes here, its sampled token dropped."""
        if seq.params.max_tokens == 0:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_LENGTH)
            self._retire(seq)
            outputs.append(RequestOutput.of(seq))
            return
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        try:
            k = seq.params.num_logprobs
            tops = (sampled_top_logprobs(rows(), k) if k and rows is not None
                    else [{} if k is not None else None for _ in tokens])
            for tok, lp, top in zip(tokens, logprobs, tops):
                self._append(seq, tok, lp, top)
                self._stats.generation_tokens += 1
                if seq.is_finished:
                    break
        except Exception as e:  # noqa: BLE001 - this request only
            self._fail(seq, e, outputs)
            return
        outputs.append(RequestOutput.of(seq))

    def _fail(self, seq: Sequence, err: BaseException, outputs: list[RequestOutput]) -> None:
        """Finish `seq` alone with finish_reason "error" (blocks and slot freed) and report it."""
        seq.error = f"request {seq.request_id!r} failed in the engine: {type(err).__name__}: {err}"
        self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR)
        self._retire(seq)
        outputs.append(RequestOutput.of(seq))

    def _append(self, seq: Sequence, tok: int, lp: float, top: dict[int, float] | None = None) -> None:
        """Add a sampled token, update the text, finish the request if a stop rule fires.

        Stop tokens (eos unless ignore_eos, stop_token_ids) stay in token_ids; a stop_token_ids token
        adds its text (none for a special token), as in vLLM, eos adds none; a
        stop string ends the text just before it (after it with include_stop_str_in_output; the
        earliest match wins). `stop_reason` records a stop token id or stop string. Until
        min_tokens tokens exist, stop strings do not fire (stop tokens are masked by the sampler).
        """
        seq.append_token(tok, lp, top)
        p = seq.params
        reason, cut = None, False
        if p.structured is not None and self.structured.accept(seq.request_id, tok):
            reason = SequenceStatus.FINISHED_STOPPED  # the grammar is complete
        if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            reason = SequenceStatus.FINISHED_STOPPED
            if tok in p.stop_token_ids:
                seq.stop_reason = tok
                if seq.detok is not None:
                    seq.output_text += seq.detok.step([tok])
        elif seq.detok is not None:
            piece = seq.detok.step([tok])
            if piece and p.stop and len(seq.output_token_ids) >= p.min_tokens:
                lo = max(0, len(seq.output_text) - max(len(s) for s in p.stop) + 1)
                seq.output_text += piece
                hits = [(k, s) for s in p.stop if (k := seq.output_text.find(s, lo)) >= 0]
                if hits:
                    k, hit = min(hits, key=lambda h: (h[0], -len(h[1])))
                    seq.output_text = seq.output_text[:k + len(hit) if p.include_stop_str_in_output else k]
                    seq.stop_reason = hit
                    reason, cut = SequenceStatus.FINISHED_STOPPED, True
            else:
                seq.output_text += piece
        if reason is None and (len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = SequenceStatus.FINISHED_LENGTH
        if reason is not None:
            if seq.detok is not None and not cut:
                seq.output_text += seq.detok.flush()
            self.scheduler.finish(seq, reason)
            self._retire(seq)

    def _retire(self, seq: Sequence) -> None:
        self.requests.pop(seq.request_id, None)
        self.structured.forget(seq.request_id)
        self._suspects.discard(seq.request_id)
        self.sampler.forget(seq.request_id)

    def stats(self) -> EngineStats:
        s = self._stats
        s.num_running = len(self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting)
        s.num_blocks_used = self.blocks.allocator.num_used
        s.num_preemptions = self.scheduler.num_preemptions
        self.prefix_caching.report(s, self.blocks)
        return dataclasses.replace(s)
