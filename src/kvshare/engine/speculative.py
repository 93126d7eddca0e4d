"""DSpark speculative decoding inside the continuous-batching engine (spec engram_dspark.md §2.10).

The `Speculator` is the engine's `Proposer` and its `Acceptor`'s verifier; the engine's step
(engine.py) runs, per isolation group:

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

The speculator computes nothing on the model itself: the draft forward and the draft-window writes
go through the `Executor` (so a tensor-parallel executor replays them on every rank), and it reads
only what it is given (block manager, sampler, statistics), not the engine.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from kvshare.cache.blocks import BlockManager
from kvshare.engine.acceptor import Accepted, Acceptance
from kvshare.engine.executor import Executor, Forward
from kvshare.engine.isolation import per_row
from kvshare.engine.sampling import Sampler
from kvshare.engine.sequence import Sequence
from kvshare.engine.logits_processors import processed_rows
from kvshare.engine.spec_accept import draft_choice, penalised_rows, verify
from kvshare.engine.spec_config import SpeculativeConfig
from kvshare.engine.step_plan import ScheduledChunk


class NoProposer:
    """The plain engine's proposer: no drafts, no taps, nothing to commit."""

    taps: tuple[int, ...] = ()
    on_commit: list[Callable[[list[Sequence], list[int]], None]] = []

    def propose(self, chunks: list[ScheduledChunk], budget: list[int]) -> None:
        pass

    def after_accept(self, committed: list[int]) -> None:
        pass

    def observe(self, seq: Sequence, accepted: Accepted) -> None:
        pass


class Speculator:
    """DSpark drafts (proposer) and their verification (the acceptor's verifier) for one engine."""

    def __init__(self, executor: Executor, sampler: Sampler, config: SpeculativeConfig, blocks: BlockManager,
                 max_model_len: int, stats: dict[str, float], structured: Any = None) -> None:
        self.executor = executor
        self.structured = structured  # engine/structured.StructuredOutputs: masks of verification rows
        self.sampler = sampler
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.stats = stats  # the engine's EngineStats.extra
        self.config = config
        self.draft = executor.draft_model
        self.windows = executor.windows
        self.k = config.num_tokens(self.draft.cfg)
        self.taps = tuple(self.draft.targets)
        # Test / benchmark hook: (sequence, K) -> K draft tokens replacing the DSpark proposal.
        self.draft_override: Callable[[Sequence, int], list[int]] | None = None
        # Per-request state of other features (e.g. n-gram history): (sequences, committed counts).
        self.on_commit: list[Callable[[list[Sequence], list[int]], None]] = []
        self.record_logits: dict[str, torch.Tensor] | None = None  # test hook: the row behind each anchor
        self.acceptance_counts = [0] * (self.k + 1)  # verifies that accepted j drafts, j = 0..K
        self._q: dict[int, torch.Tensor] = {}  # id(chunk) -> its drafts' distributions [K_i, V]

    # ---- 1. propose -------------------------------------------------------------------------------
    def _budget(self, chunks: list[ScheduledChunk], left: list[int]) -> list[tuple[int, int]]:
        """(chunk index, K_i >= 1) of the chunks that speculate; allocates their blocks. `left[0]`:
        the step's token budget still free (drafts spend it)."""
        blocks = self.blocks
        out = []
        for i, c in enumerate(chunks):
            if left[0] <= 0 or not c.is_decode:
                continue
            seq = c.seq
            n = min(self.k, seq.params.max_tokens - len(seq.output_token_ids) - 1, left[0],
                    self.max_model_len - seq.num_tokens)
            have = len(blocks.block_ids[seq.slot])
            n = min(n, (have + blocks.allocator.num_free) * blocks.block_size - seq.num_tokens)
            if n >= 1:
                blocks.grow(seq.slot, seq.num_tokens + n)
                out.append((i, n))
                left[0] -= n
        return out

    def propose(self, chunks: list[ScheduledChunk], budget: list[int]) -> None:
        """Give each decode chunk that may speculate its drafts (`chunk.draft`)."""
        self._q.clear()
        picked = self._budget(chunks, budget)
        if not picked:
            return
        drafts, q = self._propose([chunks[i].seq for i, _ in picked], [k for _, k in picked])
        for n, ((i, k), d) in enumerate(zip(picked, drafts)):
            chunks[i].draft = d
            if q is not None:
                self._q[id(chunks[i])] = q[n, :k]

    @torch.inference_mode()
    def _propose(self, seqs: list[Sequence], ks: list[int]) -> tuple[list[list[int]], torch.Tensor | None]:
        """Drafts per sequence (K_i each) and their distributions q [N, K, V] (None: deterministic)."""
        if self.draft_override is not None:
            return [list(self.draft_override(s, k))[:k] for s, k in zip(seqs, ks)], None
        dev = self.executor.pool.device
        anchors = torch.tensor([s.output_token_ids[-1] for s in seqs], device=dev)
        pos = torch.tensor([s.num_computed for s in seqs], device=dev)
        slots = torch.tensor([s.slot for s in seqs], device=dev)
        u, x_head = self.executor.draft(anchors, pos, slots)
        params, ids = [s.params for s in seqs], [s.request_id for s in seqs]
        prev, toks, qs, conf = anchors, [], [], []
        for j in range(max(ks)):  # the Markov loop: sequential in j, batched over sequences
            bias, m = self.draft.markov_bias(prev)
            conf.append(self.draft.confidence(x_head[:, j], m))
            prev, q = draft_choice(u[:, j] + bias, params, ids, self.sampler)
            toks.append(prev)
            qs.append(q)
        # The confidence head feeds statistics only (no adaptive trimming): its mean over drafted rows.
        drafted = torch.arange(len(conf), device=dev)[None, :] < torch.tensor(ks, device=dev)[:, None]
        st = self.stats
        st["spec_confidence_sum"] = st.get("spec_confidence_sum", 0.0) + float(torch.stack(conf, 1)[drafted].sum())
        drafts = torch.stack(toks, 1).tolist()
        q_all = None if any(q is None for q in qs) else torch.stack(qs, 1)  # type: ignore[misc]
        return [d[:k] for d, k in zip(drafts, ks)], q_all

    # ---- 3. verify --------------------------------------------------------------------------------
    def verify(self, fwd: Forward, drafted: list[int], first_row: list[int]) -> Acceptance:
        """Accepted drafts + bonus of each drafted chunk (indices `drafted`; its logits rows start at
        `first_row`); a row whose verification raises fails alone."""
        results = per_row(lambda sub: self._verify(fwd, [drafted[j] for j in sub], [first_row[j] for j in sub]),
                          len(drafted))
        return dict(zip(drafted, results))

    @torch.inference_mode()
    def _verify(self, fwd: Forward, idx: list[int], first_row: list[int]) -> list[Accepted]:
        chunks, logits, dev = fwd.chunks, fwd.logits, fwd.logits.device
        ks = [len(chunks[i].draft) for i in idx]
        k_max = max(ks)
        rows = torch.tensor([[f + min(j, k) for j in range(k_max + 1)] for f, k in zip(first_row, ks)], device=dev)
        d = torch.tensor([chunks[i].draft + [-1] * (k_max - len(chunks[i].draft)) for i in idx], device=dev)
        seqs = [chunks[i].seq for i in idx]
        qs = [self._q.get(id(chunks[i])) for i in idx]
        q = None
        if all(x is not None for x in qs):
            q = torch.stack([torch.nn.functional.pad(x, (0, 0, 0, k_max - x.shape[0])) for x in qs])  # type: ignore
        drafts = [chunks[i].draft for i in idx]
        masks = (self.structured.draft_masks([s.request_id for s in seqs], drafts, k_max + 1)
                 if self.structured is not None else None)
        verified = penalised_rows(processed_rows(logits[rows], seqs, self.sampler.eos_ids, masks), drafts, seqs,
                                  self.sampler.penalty_counts)
        acc, bonus = verify(verified, d, torch.tensor(ks, device=dev), q, [s.params for s in seqs],
                            [s.request_id for s in seqs], self.sampler)
        lsm = torch.log_softmax(logits.float(), dim=-1)
        out = []
        for n, i in enumerate(idx):
            a = int(acc[n])
            toks = chunks[i].draft[:a] + [int(bonus[n])]
            lps = lsm[rows[n, : a + 1], torch.tensor(toks, device=dev)].tolist()
            out.append(Accepted(toks, lps, logits, first_row[n] + a))  # token j: row first_row[n] + j
            self.acceptance_counts[a] += 1
        st = self.stats
        st["spec_num_verifies"] = st.get("spec_num_verifies", 0) + len(idx)
        st["spec_draft_tokens"] = st.get("spec_draft_tokens", 0) + sum(ks)
        st["spec_accepted_tokens"] = st.get("spec_accepted_tokens", 0) + int(acc.sum())
        st["spec_mean_accepted_length"] = 1 + st["spec_accepted_tokens"] / st["spec_num_verifies"]
        if "spec_confidence_sum" in st:
            st["spec_mean_draft_confidence"] = st["spec_confidence_sum"] / st["spec_draft_tokens"]
        return out

    # ---- 4. commit --------------------------------------------------------------------------------
    def after_accept(self, committed: list[int]) -> None:
        """The draft windows get the context rows of the last forward's committed tokens."""
        self._q.clear()
        self.executor.write_draft_context(committed)

    def observe(self, seq: Sequence, accepted: Accepted) -> None:
        """Keep the logits row behind a request's newest token (test hook `record_logits`)."""
        if self.record_logits is not None:
            self.record_logits[seq.request_id] = accepted.row
