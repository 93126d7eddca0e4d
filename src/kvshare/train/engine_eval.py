"""Bits per byte through the serving engine: paged block pool, continuous batching, chunked prefill.

The engine API has no prompt log-probabilities (its ModelRunner asks the model for the logits of
the last row of each chunk only). `ScoringRunner` is a ModelRunner that asks for every row instead,
records the log-likelihood of each prompt token given its prefix, and hands the engine the same
sampling-row logits it would otherwise get; the engine's executor runs its forwards through it
(``Executor.using``) for the scoring run. Everything else is the real engine: its scheduler
splits prompts into chunks of at most ``max_num_batched_tokens`` tokens across steps and batches
several requests per step, the PagedBackend stores the packed quantised cache in the block pool.
Each piece is one request ``[bos] + piece`` with ``max_tokens=1``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F

from kvshare.engine.model_runner import ModelRunner
from kvshare.engine.sampling import SamplingParams
from kvshare.llm import LLM
from kvshare.tokenizer import ByteTokenizer
from kvshare.train.data import BOS


class ScoringRunner(ModelRunner):
    """A ModelRunner that also records per-token negative log-likelihoods of prompt tokens.

    ``nll[request_id]`` accumulates (sum of nats, number of scored tokens) over the request's chunks.
    """

    def __init__(self, base: ModelRunner) -> None:
        super().__init__(base.model, base.backend, base.blocks, base.device)
        self.nll: dict[str, list[float]] = {}

    @torch.inference_mode()
    def run(self, chunks: list[Any]) -> tuple[torch.Tensor, list[int]]:
        """One engine step with logits for every row; returns what `ModelRunner.run` returns."""
        input_ids, batch, sampling = self.build_batch(chunks)
        batch.logit_rows = None
        logits = self.model(input_ids, batch, self.backend)  # the executor ends the backend's step
        logp = F.log_softmax(logits.float(), dim=-1)
        off = 0
        for c in chunks:
            prompt = c.seq.prompt_token_ids
            last = min(c.start + c.length, len(prompt) - 1)  # positions p < last have a prompt target
            if last > c.start:
                n = last - c.start
                tgt = torch.tensor(prompt[c.start + 1 : last + 1], dtype=torch.int64, device=logp.device)
                lp = logp[off : off + n].gather(1, tgt[:, None]).double().sum()
                acc = self.nll.setdefault(c.seq.request_id, [0.0, 0.0])
                acc[0] -= float(lp)
                acc[1] += n
            off += c.length
        rows = batch.cu_seqlens[1:] - 1
        out = logits.index_select(0, rows)
        if len(sampling) != len(chunks):
            out = out.index_select(0, torch.tensor(sampling, dtype=torch.int64, device=out.device))
        return out.float(), sampling


def build_llm(model: Any, chunk: int, max_num_batched_tokens: int = 256, max_num_seqs: int = 8) -> LLM:
    """An engine over `model` (byte tokenizer), sized for pieces of `chunk` bytes.

    ``max_num_batched_tokens`` below the piece length forces chunked prefill.
    """
    return LLM(model, tokenizer=ByteTokenizer(model.cfg.vocab_size), max_num_seqs=max_num_seqs,
               max_num_batched_tokens=max_num_batched_tokens, max_model_len=max(chunk + 256, 1024))


@torch.inference_mode()
def engine_bits_per_byte(llm: LLM, pieces: list[torch.Tensor],
                         progress: Callable[[int, int], None] | None = None) -> float:
    """Bits per byte of the engine's model on the pieces (each ``[bos] + piece``, every byte scored).

    `progress(done, total)` is called after each engine step with the number of finished pieces."""
    engine = llm.engine
    scorer = ScoringRunner(engine.runner)
    with engine.executor.using(scorer):
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        ids = []
        for i, p in enumerate(pieces):
            rid = f"score-{i}"
            engine.add_request(rid, [BOS] + [int(b) for b in p.tolist()], params)
            ids.append(rid)
        done = 0
        while engine.has_unfinished_requests():
            done += sum(1 for o in engine.step() if o.finished)
            if progress is not None:
                progress(done, len(ids))
    nats = sum(scorer.nll[r][0] for r in ids)
    n = sum(scorer.nll[r][1] for r in ids)
    want = sum(int(p.numel()) for p in pieces)
    if n != want:
        raise RuntimeError(f"engine scored {n} tokens, expected {want}")
    return nats / n / math.log(2)
