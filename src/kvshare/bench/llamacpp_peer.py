"""The llama.cpp peer: greedy generation through llama.cpp's C API (``llama_cpp``'s ctypes binding).

A batch of B prompts runs as B sequences of one context (``n_seq_max = B``, one KV stream per
sequence; `LlamaCppSession`): the prefill is one ``llama_decode`` of all B x L prompt tokens
(token ``i`` of prompt ``s`` at position ``i`` of sequence ``s``, logits only for each prompt's
last token) followed by the argmax of the B logit rows; each decode step is one ``llama_decode``
of the B last tokens (one per sequence) and their argmax (the logits are copied out of
llama.cpp's buffer, B x vocab floats, inside the timed step). The timed regions match kvshare's
(``kv_generate``) and transformers' (``hf_generate``): prefill = prompts in until every first
token is out, decode step = one new token for every sequence. Threads: ``n_threads = n_threads_batch = threads``.
Memory: the peak RSS the context and the run added (the weights, mapped at load, are not in it).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import tempfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from kvshare.bench.gen import GenResult
from kvshare.bench.measure import PeakMemory, StepTimes, now

_LOG_SINK: Any = None


def _quiet(llama_cpp: Any) -> None:
    """Route llama.cpp's log lines to nowhere (they would interleave with the benchmark tables)."""
    global _LOG_SINK
    if _LOG_SINK is None:
        _LOG_SINK = llama_cpp.llama_log_callback(lambda level, text, user: None)
        llama_cpp.llama_log_set(_LOG_SINK, ctypes.c_void_p(0))


class LlamaCppModel:
    """A GGUF loaded by llama.cpp (CPU only); `close` frees it."""

    def __init__(self, path: Path, label: str) -> None:
        import llama_cpp

        _quiet(llama_cpp)
        llama_cpp.llama_backend_init()
        self.lib = llama_cpp
        self.label = label
        self.path = Path(path)
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0
        # No extra CPU buffer types: on a CPU with AMX, llama.cpp 0.3.36 puts Q8_0 weights in its AMX
        # buffer, where this model's Q8_0 matmuls crash (SIGSEGV in ggml_backend_amx_mul_mat) and
        # the grouped wo_a product has no kernel (context creation aborts: GGML_ASSERT
        # *cur_backend_id != -1). BF16 / F32 weights never use those buffers.
        params.use_extra_bufts = False
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))

    def close(self) -> None:
        if self.model:
            self.lib.llama_model_free(self.model)
            self.model = None

    def new_context(self, n_seq: int, max_len: int, n_batch: int, threads: int, fp32_attention: bool = False) -> Any:
        """A context for `n_seq` sequences of up to `max_len` tokens each, `n_batch` tokens per decode call.

        llama.cpp's defaults (what the benchmark measures): an f16 KV cache and, on CPU, flash
        attention, whose kernel also rounds the queries to f16. `fp32_attention` keeps both in fp32
        (f32 cache, flash attention off) for the comparison with kvshare's fp32 model."""
        lc = self.lib
        p = lc.llama_context_default_params()
        if fp32_attention:
            p.type_k = p.type_v = lc.GGML_TYPE_F32
            p.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.n_seq_max = n_seq
        p.n_ctx = n_seq * 256 * math.ceil(max_len / 256)  # split evenly: one stream per sequence
        p.n_batch = n_batch
        p.n_ubatch = min(n_batch, p.n_ubatch)
        p.n_threads = threads
        p.n_threads_batch = threads
        p.no_perf = True
        ctx = lc.llama_init_from_model(self.model, p)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {n_seq} x {max_len} tokens")
        return ctx


class LlamaCppSession:
    """One context of `n_seq` sequences over a loaded model; `close` frees it.

    `prefill` feeds every sequence's tokens from position 0 in one ``llama_decode``; `step` feeds
    one token per sequence at the next position. Both return the logits llama.cpp produced, one
    [n, n_vocab] float32 array per sequence (n = 1, or every position with ``all_logits``)."""

    def __init__(self, model: LlamaCppModel, n_seq: int, max_len: int, n_batch: int, threads: int = 1,
                 fp32_attention: bool = False) -> None:
        self.lib = model.lib
        self.n_vocab = model.n_vocab
        self.ctx = model.new_context(n_seq, max_len, n_batch, threads, fp32_attention)
        self.batch = self.lib.llama_batch_init(n_batch, 0, 1)
        self.n_batch = n_batch
        self.pos = [0] * n_seq

    def close(self) -> None:
        if self.ctx is not None:
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            self.ctx = None

    def _decode(self, tokens: list[list[int]], all_logits: bool) -> list[np.ndarray]:
        total = sum(len(t) for t in tokens)
        if total > self.n_batch:
            raise ValueError(f"{total} tokens do not fit the context's batch of {self.n_batch}")
        b = self.batch
        n = 0
        rows: list[list[int]] = []
        for s, toks in enumerate(tokens):
            rows.append([])
            for j, t in enumerate(toks):
                b.token[n], b.pos[n], b.n_seq_id[n] = t, self.pos[s] + j, 1
                b.seq_id[n][0] = s
                b.logits[n] = all_logits or j == len(toks) - 1
                if b.logits[n]:
                    rows[-1].append(n)
                n += 1
            self.pos[s] += len(toks)
        b.n_tokens = n
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode of {n} tokens returned {rc}")
        out = []
        for seq_rows in rows:
            arr = np.empty((len(seq_rows), self.n_vocab), dtype=np.float32)
            for k, i in enumerate(seq_rows):
                ptr = self.lib.llama_get_logits_ith(self.ctx, i)
                if not ptr:
                    raise RuntimeError(f"llama.cpp returned no logits for batch row {i}")
                arr[k] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
            out.append(arr)
        return out

    def prefill(self, prompts: list[list[int]], all_logits: bool = False) -> list[np.ndarray]:
        """Every prompt as its sequence from position 0; logits of the last (or every) position."""
        if any(self.pos):
            raise RuntimeError("prefill starts the sequences at position 0; use a fresh session")
        return self._decode(prompts, all_logits)

    def step(self, tokens: list[int]) -> list[np.ndarray]:
        """One token per sequence at its next position; each sequence's [1, n_vocab] logits."""
        return self._decode([[t] for t in tokens], False)


def lc_generate(model: LlamaCppModel, prompts: torch.Tensor, new_tokens: int, threads: int = 1) -> GenResult:
    """One timed greedy generation of exactly `new_tokens` tokens per prompt (see module docstring)."""
    b, length = prompts.shape
    seqs = prompts.tolist()
    with PeakMemory("cpu") as mem:
        sess = LlamaCppSession(model, b, length + new_tokens, b * length, threads)
        try:
            t0 = now()
            tokens = [[int(x[-1].argmax())] for x in sess.prefill(seqs)]
            prefill_s = now() - t0
            steps = StepTimes()
            for _ in range(new_tokens - 1):
                t0 = now()
                for tok, x in zip(tokens, sess.step([t[-1] for t in tokens])):
                    tok.append(int(x[-1].argmax()))
                steps.add(now() - t0)
        finally:
            sess.close()
    return GenResult(f"llama.cpp {model.label}", b, length, tokens, prefill_s, steps, mem.as_dict())


def lc_warmup(model: LlamaCppModel, prompts: torch.Tensor, threads: int = 1) -> None:
    """A short generation so one-time costs (first touch of the mapped weights, allocator growth)
    stay out of the timed run."""
    lc_generate(model, prompts[:, : min(prompts.shape[1], 32)], 2, threads)


def unsupported(cfg: Any) -> str | None:
    """Why llama.cpp's ``deepseek4`` cannot run `cfg`, or None. These configs would abort the process
    inside llama.cpp (a GGML_ASSERT), so they are refused before loading."""
    ratios = set(cfg.compress_ratios[: cfg.num_hidden_layers])
    if cfg.arch != "v4":
        return f"llama.cpp's deepseek4 runs DeepSeek-V4 models only (this is {cfg.arch})"
    if not ratios <= {0, 4, 128}:
        return f"llama.cpp's deepseek4 supports compress ratios 0, 4 and 128 only, got {sorted(ratios)}"
    if cfg.index_head_dim % 64:
        return (f"llama.cpp's deepseek4 rotates index keys with a Hadamard matrix of at least 64 x 64, so "
                f"index_head_dim must be a multiple of 64 (got {cfg.index_head_dim})")
    if not ratios - {0}:
        return ("llama.cpp's deepseek4 needs a compressed layer (ratio 4 or 128): context creation dies of a "
                "division by zero (SIGFPE) when every layer is a sliding-window one; use 3 or more V4 layers")
    if cfg.hc_mult != 4:
        return f"llama.cpp's deepseek4 asserts hc_mult == 4 (got {cfg.hc_mult})"
    return None


def open_peers(model: torch.nn.Module, cfg: Any, dtype: str, workdir: Path,
               fetch: bool = True) -> tuple[list[LlamaCppModel], str | None]:
    """llama.cpp on `model`'s weights: ([checkpoint-dtype GGUF, q8_0 GGUF], None), or ([], reason).

    The reason is a one-line note for the report (binding missing, converter absent and not
    fetched). The GGUFs are written under `workdir`, which must outlive the returned models."""
    from kvshare.bench import llamacpp_files as files

    reason = files.binding_available() or unsupported(cfg)
    if reason is not None:
        return [], reason
    converter = files.converter_dir()
    if converter is None:
        if not fetch:
            return [], (f"llama.cpp's converter is not in {files.cache_dir()} (and fetching it is off; "
                        "set KVSHARE_LLAMACPP_SRC to a llama.cpp source directory)")
        converter = files.fetch_converter()
    label = {"bfloat16": "bf16", "float32": "f32"}[dtype]
    paths = files.write_ggufs(model, cfg, workdir, converter, label)
    return [LlamaCppModel(p, name) for name, p in paths.items()], None


@contextlib.contextmanager
def llamacpp_peers(model: torch.nn.Module, cfg: Any, dtype: str, device: str, enabled: bool = True,
                   fetch: bool = True) -> Iterator[tuple[list[LlamaCppModel], str]]:
    """`open_peers` in a temporary directory: yields (models, one-line note for the report) and frees
    the models and their GGUFs on exit. No models on a non-CPU device (this peer is CPU only)."""
    from kvshare.bench.llamacpp_files import LLAMA_CPP_PYTHON

    with tempfile.TemporaryDirectory(prefix="kvshare-gguf-") as tmp:
        models: list[LlamaCppModel] = []
        if not enabled:
            note = "llama.cpp: not requested (--no-llamacpp)"
        elif device != "cpu":
            note = f"llama.cpp: skipped, the peer runs on CPU only (device {device})"
        else:
            models, reason = open_peers(model, cfg, dtype, Path(tmp), fetch)
            note = f"llama.cpp: skipped, {reason}" if reason else (
                f"llama.cpp (llama-cpp-python {LLAMA_CPP_PYTHON}): GGUFs {', '.join(m.label for m in models)} of "
                "these weights (llama.cpp's converter, kvshare.bench.gguf_v4); a batch is one context "
                "with n_seq_max = batch")
        try:
            yield models, note
        finally:
            for m in models:
                m.close()
