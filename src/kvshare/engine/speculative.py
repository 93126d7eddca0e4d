"""DSpark speculative decoding inside the continuous-batching engine (spec engram_dspark.md §2.10).

One ``step(sched)`` replaces the engine's forward + sample for every scheduled chunk:

1. **Propose.** Decode chunks (one uncomputed token, the anchor, already generated) of requests
   that may speculate get up to K drafts: one batched draft forward of all their blocks, then the
   Markov loop (K sequential positions, batched over sequences). A request speculates unless it
   has < 2 tokens left to generate. Each
   gets blocks for positions a .. a+K_i; K_i shrinks to what the pool, the step's token budget and
   max_model_len allow (0: it decodes plainly in the same step).
2. **Verify.** One target forward over every chunk, drafts appended to their chunk; taps at the
   DSpark target layers are recorded for every row.
3. **Accept** (`spec_accept.verify`): greedy or rejection sampling; other sampling chunks sample
   normally.
4. **Commit** only ``anchor + accepted drafts`` (plus whole prefill chunks): ``num_computed``
   advances by them, the draft windows get their context rows, blocks past the committed tokens are
   freed; the accepted drafts and the bonus are appended one by one (stop rules apply per token);
   the bonus is the next anchor.

Rollback that loses nothing: the target's window and compressor rings have one slack row per
draft (the layout's ``window_slack`` / ``state_slack``), so the rows written for rejected
positions a+k+1 .. a+K land on ring rows of positions <= a - depth, which no later step reads,
while every committed row a later step reads is written; rejected compressed rows are rewritten
before any query can select them (a query reads only completed groups). Draft windows are
written for committed positions only. Per-request state of other features advances through the
``on_commit`` hooks, called with the committed token count of every chunk.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from kvshare.engine.outputs import RequestOutput
from kvshare.engine.scheduler import ScheduledChunk, SchedulerOutput
from kvshare.engine.sequence import Sequence
from kvshare.engine.logits_processors import processed_rows
from kvshare.engine.spec_accept import draft_choice, penalised_rows, verify
from kvshare.engine.spec_config import SpeculativeConfig
from kvshare.model.dspark import DSparkDraft
from kvshare.runtime import StepState

log = logging.getLogger(__name__)


class Speculator:
    """Drafts, verifies and commits for one LLMEngine (built when speculative_config is set)."""

    def __init__(self, engine: Any, config: SpeculativeConfig) -> None:
        self.engine = engine
        self.config = config
        self.k = config.num_tokens(engine.cfg)
        self.draft = DSparkDraft(engine.model)
        self.windows = self.draft.windows(engine.backend)
        # Test / benchmark hook: (sequence, K) -> K draft tokens replacing the DSpark proposal.
        self.draft_override: Callable[[Sequence, int], list[int]] | None = None
        # Per-request state of other features (e.g. n-gram history): (sequences, committed counts).
        self.on_commit: list[Callable[[list[Sequence], list[int]], None]] = []
        self.record_logits: dict[str, torch.Tensor] | None = None  # test hook: the row behind each anchor
        self.acceptance_counts = [0] * (self.k + 1)  # verifies that accepted j drafts, j = 0..K

    # ---- 1. propose -------------------------------------------------------------------------------
    @staticmethod
    def _is_decode(c: ScheduledChunk) -> bool:
        return c.samples and c.length == 1 and c.start >= len(c.seq.prompt_token_ids)

    def _budget(self, chunks: list[ScheduledChunk], left: list[int]) -> list[tuple[int, int]]:
        """(chunk index, K_i >= 1) of the chunks that speculate; allocates their blocks. `left[0]`:
        the step's token budget still free (drafts spend it)."""
        eng = self.engine
        blocks = eng.blocks
        out = []
        for i, c in enumerate(chunks):
            if left[0] <= 0 or not self._is_decode(c):
                continue
            seq = c.seq
            n = min(self.k, seq.params.max_tokens - len(seq.output_token_ids) - 1, left[0],
                    eng.max_model_len - seq.num_tokens)
            have = len(blocks.block_ids[seq.slot])
            n = min(n, (have + blocks.allocator.num_free) * blocks.block_size - seq.num_tokens)
            if n >= 1:
                blocks.grow(seq.slot, seq.num_tokens + n)
                out.append((i, n))
                left[0] -= n
        return out

    def _propose(self, seqs: list[Sequence], ks: list[int]) -> tuple[list[list[int]], torch.Tensor | None]:
        """Drafts per sequence (K_i each) and their distributions q [N, K, V] (None: deterministic)."""
        if self.draft_override is not None:
            return [list(self.draft_override(s, k))[:k] for s, k in zip(seqs, ks)], None
        dev = self.engine.device
        anchors = torch.tensor([s.output_token_ids[-1] for s in seqs], device=dev)
        pos = torch.tensor([s.num_computed for s in seqs], device=dev)
        slots = torch.tensor([s.slot for s in seqs], device=dev)
        u, x_head = self.draft.block_forward(self.windows, anchors, pos, slots)
        params, ids = [s.params for s in seqs], [s.request_id for s in seqs]
        prev, toks, qs, conf = anchors, [], [], []
        for j in range(max(ks)):  # the Markov loop: sequential in j, batched over sequences
            bias, m = self.draft.markov_bias(prev)
            conf.append(self.draft.confidence(x_head[:, j], m))
            prev, q = draft_choice(u[:, j] + bias, params, ids, self.engine.sampler)
            toks.append(prev)
            qs.append(q)
        # The confidence head feeds statistics only (no adaptive trimming): its mean over drafted rows.
        drafted = torch.arange(len(conf), device=dev)[None, :] < torch.tensor(ks, device=dev)[:, None]
        st = self.engine._stats.extra
        st["spec_confidence_sum"] = st.get("spec_confidence_sum", 0.0) + float(torch.stack(conf, 1)[drafted].sum())
        drafts = torch.stack(toks, 1).tolist()
        q_all = None if any(q is None for q in qs) else torch.stack(qs, 1)  # type: ignore[misc]
        return [d[:k] for d, k in zip(drafts, ks)], q_all

    # ---- 2-4. verify and commit -----------------------------------------------------------------------
    def step(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """One engine step: the step's outputs. Per-request failure isolation as in the plain path
        (`engine/isolation.py`): a failing batch is requeued and its requests marked suspect; a
        suspect runs alone next time, and fails alone (finish_reason "error") if it fails again."""
        eng = self.engine
        suspects = eng._suspects
        clean = [c for c in sched.chunks if c.seq.request_id not in suspects]
        groups = ([clean] if clean else []) + [[c] for c in sched.chunks if c.seq.request_id in suspects]
        left = [eng.scheduler.max_num_batched_tokens - sched.num_tokens]
        outputs: list[RequestOutput] = []
        for group in groups:
            try:
                outputs += self._step_group(group, left)
            except Exception as e:  # noqa: BLE001 - contained to this group, as in run_isolated
                if len(group) == 1:
                    suspects.discard(group[0].seq.request_id)
                    eng._fail(group[0].seq, e, outputs)
                else:
                    log.warning("a speculative step of %d requests failed (%s: %s); rerunning them one by one",
                                len(group), type(e).__name__, e)
                    for c in group:
                        eng.scheduler.requeue(c.seq)
                    suspects.update(c.seq.request_id for c in group)
                continue
            if len(group) == 1:
                suspects.discard(group[0].seq.request_id)
        return outputs

    @torch.inference_mode()
    def _step_group(self, chunks: list[ScheduledChunk], left: list[int]) -> list[RequestOutput]:
        """Propose, verify in one forward, accept, commit (module doc) for one group of chunks."""
        eng = self.engine
        picked = self._budget(chunks, left)
        q = None
        if picked:
            drafts, q = self._propose([chunks[i].seq for i, _ in picked], [k for _, k in picked])
            for (i, _), d in zip(picked, drafts):
                chunks[i].draft = d
        input_ids, batch, _ = eng.runner.build_batch(chunks)
        state = StepState(taps={t: None for t in self.draft.targets})
        if eng.prefix is not None:  # prefix caching: ring rows at block boundaries (engine/prefix_caching.py)
            eng.prefix.start_capture(chunks)
        ok = False
        try:
            logits = eng.model(input_ids, batch, eng.backend, state)
            ok = True
        finally:
            eng.backend.end_step()
            if eng.prefix is not None:
                eng.prefix.finish_capture(chunks, ok)
        ends = torch.cumsum(torch.tensor([1 + len(c.draft) for c in chunks]), 0).tolist()  # logit rows
        committed = [c.length for c in chunks]
        new_tokens: dict[int, tuple[list[int], list[float], torch.Tensor]] = {}
        plain = [i for i, c in enumerate(chunks) if c.samples and not c.draft]
        if plain:
            rows = torch.tensor([ends[i] - 1 for i in plain])
            seqs = [chunks[i].seq for i in plain]
            toks, lps = eng.sampler(logits[rows].float(), [s.params for s in seqs], [s.request_id for s in seqs],
                                    [(s.prompt_token_ids, s.output_token_ids) for s in seqs])
            for i, t, lp, r in zip(plain, toks.tolist(), lps.tolist(), rows.tolist()):
                new_tokens[i] = ([t], [lp], logits[r:r + 1])
        if picked:
            for i, (toks, lps, row) in self._accept(chunks, picked, logits, ends, q).items():
                new_tokens[i] = (toks, lps, row)
                committed[i] += len(toks) - 1
        return self._commit(chunks, committed, state.taps, batch, new_tokens)

    def _accept(self, chunks: list[ScheduledChunk], picked: list[tuple[int, int]], logits: torch.Tensor,
                ends: list[int], q: torch.Tensor | None) -> dict[int, tuple[list[int], list[float], torch.Tensor]]:
        """Verify the drafted chunks: chunk index -> (accepted drafts + bonus, their logprobs, the
        logits rows behind them); updates the acceptance statistics."""
        eng, dev = self.engine, logits.device
        idx = [i for i, _ in picked]
        k_max = max(k for _, k in picked)
        rows = torch.tensor([[min(ends[i] - 1 - k + j, ends[i] - 1) for j in range(k_max + 1)] for i, k in picked],
                            device=dev)
        d = torch.tensor([chunks[i].draft + [-1] * (k_max - len(chunks[i].draft)) for i in idx], device=dev)
        seqs = [chunks[i].seq for i in idx]
        drafts = [chunks[i].draft for i in idx]
        masks = eng.structured.draft_masks([s.request_id for s in seqs], drafts, k_max + 1)
        verified = penalised_rows(processed_rows(logits[rows], seqs, eng.eos_ids, masks), drafts, seqs)
        acc, bonus = verify(verified, d, torch.tensor([k for _, k in picked], device=dev),
                            q[:, :k_max] if q is not None else None, [s.params for s in seqs],
                            [s.request_id for s in seqs], eng.sampler)
        lsm = torch.log_softmax(logits.float(), dim=-1)
        out = {}
        for n, i in enumerate(idx):
            a = int(acc[n])
            toks = chunks[i].draft[:a] + [int(bonus[n])]
            lps = lsm[rows[n, : a + 1], torch.tensor(toks, device=dev)].tolist()
            out[i] = (toks, lps, logits[rows[n, : a + 1]])
            self.acceptance_counts[a] += 1
        st = eng._stats.extra
        st["spec_num_verifies"] = st.get("spec_num_verifies", 0) + len(picked)
        st["spec_draft_tokens"] = st.get("spec_draft_tokens", 0) + sum(k for _, k in picked)
        st["spec_accepted_tokens"] = st.get("spec_accepted_tokens", 0) + int(acc.sum())
        st["spec_mean_accepted_length"] = 1 + st["spec_accepted_tokens"] / st["spec_num_verifies"]
        if "spec_confidence_sum" in st:
            st["spec_mean_draft_confidence"] = st["spec_confidence_sum"] / st["spec_draft_tokens"]
        return out

    def _commit(self, chunks: list[ScheduledChunk], committed: list[int], taps: dict, batch: Any,
                new_tokens: dict[int, tuple[list[int], list[float], torch.Tensor]]) -> list[RequestOutput]:
        """Advance every chunk's sequence by its committed tokens (their draft context rows from the
        taps, blocks past them freed), then append the new tokens in chunk order."""
        eng = self.engine
        dev = batch.positions.device
        n_c = torch.tensor(committed, device=dev)  # each chunk's first rows are its committed ones
        first = torch.repeat_interleave(batch.cu_seqlens[:-1], n_c)
        offset = torch.repeat_interleave(torch.cumsum(n_c, 0) - n_c, n_c)
        rows = first + torch.arange(int(n_c.sum()), device=dev) - offset
        main_x = self.draft.main_x({t: v[rows] for t, v in taps.items() if v is not None})
        self.draft.write_context(self.windows, main_x, batch.slots[batch.seq_index[rows]], batch.positions[rows])
        for c, n in zip(chunks, committed):
            c.seq.num_computed += n
            c.seq.new_token_ids = []
            eng.blocks.shrink(c.seq.slot, c.seq.num_computed)
        if eng.prefix is not None:  # before the appends: a request finishing below checkpoints at release
            eng.prefix.end_step(chunks, final=False)
        for hook in self.on_commit:
            hook([c.seq for c in chunks], committed)
        eng._stats.num_steps += 1
        eng._stats.prompt_tokens += sum(c.length for c in chunks if not self._is_decode(c))
        outputs = []
        now = time.perf_counter()
        for i in sorted(new_tokens):
            toks, lps, row = new_tokens[i]
            seq = chunks[i].seq
            if self.record_logits is not None:
                self.record_logits[seq.request_id] = row[-1]
            eng._emit(seq, toks, lps, now, outputs, row)
        if eng.prefix is not None:  # accepted drafts are token ids now: their blocks and boundaries
            eng.prefix.end_step(chunks)
        return outputs
