"""LLMEngine: requests in, one scheduler step at a time, RequestOutputs out.

``step()``: schedule (continuous batching, chunked prefill, preemption) -> ModelRunner (one batched
forward over the paged cache) -> Sampler (batched) -> per-request bookkeeping (stop checks,
detokenisation) -> outputs of the requests that got a token or finished.

Invariants: a request that fails validation raises RequestError from ``add_request`` and leaves
the engine untouched; a finished or aborted request holds no blocks and no slot. A request that
fails inside a step (forward, sampling or bookkeeping) finishes alone with finish_reason "error";
the others continue with unchanged outputs (``isolation``), and the engine stays usable.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any

import torch

from kvshare.cache.blocks import BlockManager
from kvshare.cache.paged_backend import PagedBackend
from kvshare.cache.pool import BlockPool
from kvshare.engine.args import (EngineArgs, apply_threads, build_layout, checkpoint_budget, pool_blocks,
                                 resolve_batch_invariant, resolve_device, resolve_dtype)
from kvshare.engine.isolation import run_isolated, sample_isolated
from kvshare.engine.logprobs import record_prompt_logprobs, sampled_top_logprobs
from kvshare.engine.structured import StructuredOutputs
from kvshare.engine.model_runner import ModelRunner
from kvshare.model.dtypes import weight_bytes
from kvshare.engine.outputs import EngineStats, RequestOutput
from kvshare.engine.prefix_caching import PrefixCaching
from kvshare.engine.sampling import Sampler, SamplingParams
from kvshare.engine.scheduler import Scheduler
from kvshare.engine.sequence import Sequence, SequenceStatus
from kvshare.errors import RequestError, SetupError


class LLMEngine:
    def __init__(self, model: Any = None, tokenizer: Any = None, args: EngineArgs | None = None,
                 **engine_args: Any) -> None:
        self.args = args = dataclasses.replace(args or EngineArgs(), **engine_args)
        self.tp = None  # kvshare.parallel.launch.TPHandle on rank 0 of a tensor-parallel engine
        if args.tensor_parallel_size != 1 and args.speculative_config is not None:
            # The speculator runs its own draft and verify forwards, which the TP workers do not replay.
            raise SetupError("--speculative-config cannot be combined with --tensor-parallel-size > 1 yet; "
                             "drop one of them")
        if args.tensor_parallel_size != 1:
            from kvshare.parallel.launch import start

            self.tp, model = start(model, args)
        model = self._load(model, args)
        model.batch_invariant = self.batch_invariant = resolve_batch_invariant(args.batch_invariant, self.device,
                                                                                 self.dtype)
        self.model = model
        self.threads = apply_threads(args.threads, model)
        self.weight_bytes = weight_bytes(model)  # as stored (bf16 with the fp32 set, or the oracle dtype)
        self.cfg = model.cfg
        self.tokenizer = tokenizer
        q = getattr(model, "quant", None)
        cache_q = bool(q.cache) if q is not None else bool(args.quantize)
        index_q = bool(q.index) if q is not None else bool(args.quantize)
        self.layout = build_layout(self.cfg, args, cache_q, index_q, self.dtype)
        model_len = min(args.max_model_len or self.cfg.max_position_embeddings, self.cfg.max_position_embeddings)
        num_blocks = pool_blocks(self.layout, args, model_len)
        capacity = (num_blocks - 1) * self.layout.block_size
        if args.max_model_len is not None and args.max_model_len > capacity:
            raise SetupError(f"max_model_len {args.max_model_len} exceeds what the pool holds ({num_blocks - 1} "
                             f"blocks x {self.layout.block_size} = {capacity} tokens); raise --memory / "
                             "--num-blocks or lower --max-model-len")
        self.max_model_len = min(model_len, capacity)
        slots = max(1, args.max_num_seqs)
        self.pool = BlockPool(self.layout, num_blocks, slots, self.device, self.dtype)
        self.backend = PagedBackend(self.pool)
        self.blocks = BlockManager(num_blocks, self.layout.block_size, slots, self.max_model_len, self.device)
        self.blocks.on_open = self._reset_slot
        self.scheduler = Scheduler(self.blocks, slots, args.max_num_batched_tokens, args.chunked_prefill)
        self.runner = ModelRunner(model, self.backend, self.blocks, self.device)
        self.prefix = None
        # Under tensor parallelism rank 0's hits are replayed on the workers (parallel/control.py).
        if args.enable_prefix_caching:
            budget = checkpoint_budget(self.layout, args)
            self.prefix = PrefixCaching(self.layout, self.pool, self.blocks, self.backend, budget,
                                        str(getattr(model, "name_or_path", "")), self.dtype)
            self.scheduler.prefix = self.prefix
        self.sampler = Sampler(self.device, args.seed or 0)
        eos = set(self.cfg.eos_token_ids)
        if tokenizer is not None:
            eos |= set(getattr(tokenizer, "eos_token_ids", None) or [])
        self.eos_ids = frozenset(i for i in eos if i is not None)
        self.sampler.eos_ids = self.eos_ids
        self.structured = StructuredOutputs(tokenizer, self.cfg.vocab_size, self.eos_ids)
        self.sampler.masks_for = self.structured.masks
        self.runner.on_prompt_rows = record_prompt_logprobs
        self.requests: dict[str, Sequence] = {}
        self._aborted: list[Sequence] = []
        self._suspects: set[str] = set()  # request ids whose chunks run alone (see isolation)
        self._order = itertools.count()
        self._stats = EngineStats(num_blocks_total=self.blocks.allocator.num_usable,
                                  bytes_per_block=self.layout.bytes_per_block)
        self.speculator = None
        if args.speculative_config is not None:
            from kvshare.engine.speculative import Speculator
            from kvshare.engine.spec_config import SpeculativeConfig

            self.speculator = Speculator(self, SpeculativeConfig.parse(args.speculative_config))
        if self.tp is not None:
            self.tp.attach(self)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at interpreter exit)."""
        if self.tp is not None:
            self.tp.close()

    def _reset_slot(self, slot: int) -> None:
        """A recycled request slot starts with zeroed rings (spec/cache.md §9.6)."""
        with torch.inference_mode():
            self.pool.reset_slots(torch.tensor([slot], device=self.device))

    def _load(self, model: Any, args: EngineArgs) -> Any:
        if model is None or isinstance(model, str):
            from kvshare.model.loader import load_model

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
            from kvshare.model.dtypes import cast_model

            model = cast_model(model, self.dtype, self.device)
        else:
            from kvshare.model.linear import pack_linears

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
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        if self.speculator is not None:  # DSpark: draft, verify and commit (engine/speculative.py)
            return outputs + self.speculator.step(sched)
        step_run = self.runner.run if self.prefix is None else self.prefix.capturing(self.runner.run)
        run = run_isolated(step_run, sched.chunks, self._suspects)
        for seq, err in run.failed:
            self._fail(seq, err, outputs)
        for seq in run.requeue:
            self.scheduler.requeue(seq)
        chunks, logits, sampling = run.chunks, run.logits, run.sampling
        decodes = 0
        for c in chunks:
            c.seq.num_computed += c.length
            c.seq.new_token_ids = []
            decodes += int(c.length == 1 and c.start >= len(c.seq.prompt_token_ids) and c.samples)
        if self.prefix is not None:
            self.prefix.end_step(chunks)
        self._stats.num_steps += 1
        self._stats.prompt_tokens += sum(c.length for c in chunks) - decodes
        if sampling:
            seqs = [chunks[i].seq for i in sampling]
            picked = sample_isolated(self.sampler, logits, [s.params for s in seqs], [s.request_id for s in seqs],
                                     [(s.prompt_token_ids, s.output_token_ids) for s in seqs])
            now = time.perf_counter()
            for j, (seq, got) in enumerate(zip(seqs, picked)):
                if isinstance(got, BaseException):
                    self._fail(seq, got, outputs)
                else:
                    self._emit(seq, [got[0]], [got[1]], now, outputs, logits[j:j + 1])
        return outputs

    def _emit(self, seq: Sequence, tokens: list[int], logprobs: list[float], now: float,
              outputs: list[RequestOutput], rows: torch.Tensor | None = None) -> None:
        """Append a request's new tokens in order (stopping at the first that finishes it), record
        its first-token time and report it. Shared by plain and speculative steps; a failure here
        (say a detokeniser error) fails this request only. `rows`: the raw logits behind each token
        (for top-k logprobs). A request with max_tokens 0 finishes here, its sampled token dropped."""
        if seq.params.max_tokens == 0:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_LENGTH)
            self._retire(seq)
            outputs.append(RequestOutput.of(seq))
            return
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        try:
            k = seq.params.num_logprobs
            tops = (sampled_top_logprobs(rows, k) if k and rows is not None
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

        Stop tokens (eos unless ignore_eos, stop_token_ids) stay in token_ids but add no text; a
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
        if self.prefix is not None:
            c = self.prefix.cache
            s.prefix_cache_queried_tokens = c.stats.queried_tokens
            s.prefix_cache_hit_tokens = c.stats.hit_tokens
            s.prefix_cache_checkpoint_bytes = c.checkpoint_bytes
            s.prefix_cache_checkpoints = len(c.checkpoints)
            s.prefix_cache_evictable_blocks = self.blocks.allocator.num_evictable
        return dataclasses.replace(s)
