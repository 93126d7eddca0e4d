"""Speculative verification (spec engram_dspark.md §2.7), batched over the verifying sequences.

Inputs per sequence i: the target's logits rows ``0 .. K_i`` (row j is the distribution of the
token after the j-th verified token; row 0 follows the anchor), drafts ``d_1 .. d_{K_i}`` and the
draft distributions ``q_j`` they were drawn from. Rows and drafts are padded to K = max K_i.

* Greedy (temperature 0): accept while ``d_{j+1} == argmax(target row j)``; the bonus is the
  argmax of row k (k = accepted count). The committed tokens equal plain greedy decoding.
* Sampling: accept ``d_{j+1}`` with probability ``min(1, p_j(d)/q_j(d))`` (u < p/q, u uniform);
  at the first rejection the bonus is drawn from ``norm(max(0, p_k - q_k))``, after K_i
  acceptances from ``p_{K_i}``. p is the target after temperature, min_p, top-k and top-p (the
  Sampler's rule), so the committed tokens are distributed as plain sampling from p.
* Penalties (`penalised_rows`): row j follows the drafts d_1..d_j, so it is penalised with the
  history (prompt, output + d_1..d_j), exactly what plain decoding applies had it produced those
  tokens; greedy and sampled acceptance then use the penalised rows.

Random draws (one uniform per draft, one exponential race for the bonus) come from the request's
own generator when it has a seed, else from the engine's.
"""

from __future__ import annotations

import torch

from typing import Any

from kvshare.engine.penalties import PenaltyCounts, penalise
from kvshare.engine.sampling import Sampler, SamplingParams, _top_k_top_p


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """p [N, R, V]: each row's distribution after its request's temperature, min_p, top-k and
    top-p, in the Sampler's order."""
    n, r, v = logits.shape
    dev = logits.device

    def per_row(values: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=dev).repeat_interleave(r)

    x = logits.reshape(n * r, v).float() / per_row([max(p.temperature, 1e-6) for p in params])[:, None]
    if any(p.min_p > 0 for p in params):
        min_p = per_row([p.min_p for p in params])
        x = x.masked_fill(x < x.max(dim=-1, keepdim=True).values + min_p.log()[:, None], float("-inf"))
    top_k = per_row([p.top_k if p.top_k > 0 else v for p in params], torch.int64).clamp(1, v)
    return torch.softmax(_top_k_top_p(x, top_k, per_row([p.top_p for p in params])), dim=-1).view(n, r, v)


def penalised_rows(logits: torch.Tensor, drafts: list[list[int]], seqs: list[Any],
                   counts: PenaltyCounts | None = None) -> torch.Tensor:
    """`logits` [N, K+1, V] with each penalised request's penalties applied row by row: row j is
    penalised with the history (prompt, output + drafts[:j]). Requests without penalties keep their
    rows as they are (the same tensor when no request has any). `counts`: the sampler's incremental
    per-request counts (a fresh count of the histories when None); the drafts are added on top."""
    n, r, v = logits.shape
    pen = [i for i, s in enumerate(seqs) if s.params.has_penalties]
    if not pen:
        return logits
    dev = logits.device
    counts = counts if counts is not None else PenaltyCounts()
    base, in_prompt = counts.rows([getattr(seqs[i], "request_id", str(i)) for i in pen],
                                  [(seqs[i].prompt_token_ids, seqs[i].output_token_ids) for i in pen], v, dev)
    # row j adds drafts[:j]: a running sum of one-hot drafts, shifted by one row
    d = torch.tensor([(drafts[i] + [0] * r)[:r - 1] for i in pen], dtype=torch.int64, device=dev)  # [P, r-1]
    live = torch.tensor([[j < len(drafts[i]) for j in range(r - 1)] for i in pen], device=dev)
    oh = torch.nn.functional.one_hot(d, v).to(torch.float32) * live[..., None]
    extra = torch.cat([torch.zeros(len(pen), 1, v, device=dev), oh.cumsum(1)], dim=1)  # [P, r, V]
    out_counts = (base[:, None, :] + extra).reshape(-1, v)
    prompt_rows = in_prompt[:, None, :].expand(-1, r, -1).reshape(-1, v)

    def per_row(name: str) -> torch.Tensor:
        return torch.tensor([getattr(seqs[i].params, name) for i in pen for _ in range(r)], dtype=torch.float32,
                            device=dev)

    flat = logits.reshape(n * r, v)
    idx = torch.tensor([i * r + j for i in pen for j in range(r)], dtype=torch.int64, device=dev)
    sub = penalise(flat.index_select(0, idx), out_counts, prompt_rows, per_row("repetition_penalty"),
                   per_row("frequency_penalty"), per_row("presence_penalty"))
    return flat.index_copy(0, idx, sub.to(flat.dtype)).view(n, r, v)


def _draws(sampler: Sampler, params: list[SamplingParams], ids: list[str], shape: tuple[int, ...],
           kind: str, device: torch.device) -> torch.Tensor:
    """[N, *shape] uniform or Exp(1) draws; seeded requests draw from their own generator."""
    out = torch.empty(len(params), *shape, device=device)
    fill = (lambda t, g: t.uniform_(generator=g)) if kind == "uniform" else (lambda t, g: t.exponential_(generator=g))
    fill(out, sampler.generator)
    for i, p in enumerate(params):
        if p.seed is not None and p.temperature > 0:
            fill(out[i], sampler.generator_for(ids[i], int(p.seed)))
    return out


def verify(logits: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, q: torch.Tensor | None,
           params: list[SamplingParams], ids: list[str], sampler: Sampler) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted counts k [N], bonus tokens [N]).

    logits [N, K+1, V] (rows past K_i unused), drafts [N, K] (entries past K_i unused), num_drafts
    [N] = K_i, q [N, K, V] draft distributions (None: every draft was deterministic, q one-hot).
    """
    n, k_max = drafts.shape
    dev = logits.device
    lf = logits.float()
    in_range = torch.arange(k_max, device=dev)[None, :] < num_drafts[:, None]
    greedy = torch.tensor([p.temperature == 0 for p in params], device=dev)
    ok = drafts == lf[:, :k_max].argmax(dim=-1)
    bonus = torch.zeros(n, dtype=torch.int64, device=dev)
    if not bool(greedy.all()):
        p = target_probs(lf, params)
        safe = drafts.clamp(min=0)
        p_d = p[:, :k_max].gather(2, safe[..., None]).squeeze(-1)
        q_d = q[:, :k_max].gather(2, safe[..., None]).squeeze(-1) if q is not None else torch.ones_like(p_d)
        u = _draws(sampler, params, ids, (k_max,), "uniform", dev)
        ok = torch.where(greedy[:, None], ok, u * q_d < p_d)
    ok = ok & in_range
    k = ok.long().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(n, device=dev)
    bonus_greedy = lf[rows, k].argmax(dim=-1)
    bonus = bonus_greedy
    if not bool(greedy.all()):
        pk = p[rows, k]
        rejected = k < num_drafts
        if q is not None:
            qk = q[rows, k.clamp(max=k_max - 1)]
        else:
            qk = torch.nn.functional.one_hot(drafts[rows, k.clamp(max=k_max - 1)].clamp(min=0), p.shape[-1]).float()
        resid = (pk - qk).clamp(min=0)
        mass = resid.sum(dim=-1, keepdim=True)
        resid = torch.where(mass > 0, resid / mass.clamp(min=1e-30), pk)
        dist = torch.where(rejected[:, None], resid, pk)
        race = _draws(sampler, params, ids, (p.shape[-1],), "exp", dev)
        bonus = torch.where(greedy, bonus_greedy, (dist / race).argmax(dim=-1))
    return k, bonus


def draft_choice(logits: torch.Tensor, params: list[SamplingParams], ids: list[str],
                 sampler: Sampler) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(draft tokens [N], their distribution q [N, V] or None if every row is greedy) from one
    Markov-corrected draft row per sequence; greedy rows take the argmax."""
    greedy = torch.tensor([p.temperature == 0 for p in params], device=logits.device)
    tok = logits.float().argmax(dim=-1)
    if bool(greedy.all()):
        return tok, None
    q = target_probs(logits[:, None], params)[:, 0]
    race = _draws(sampler, params, ids, (q.shape[-1],), "exp", logits.device)
    sampled = (q / race).argmax(dim=-1)
    one_hot = torch.nn.functional.one_hot(tok, q.shape[-1]).to(q.dtype)
    return torch.where(greedy, tok, sampled), torch.where(greedy[:, None], one_hot, q)
