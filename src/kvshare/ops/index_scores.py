"""Lightning-indexer scores (spec/model.md §4.6): I[t, j] = sum_h w[t, h] * ReLU(q[t, h] . k[j]).

**kvshare decision (§13):** the dot products and the head sum are accumulated in fp32 (the
spec allows it: "index scores may be accumulated in fp32 even when the model runs in bf16"),
or in float64 when the queries are float64 (the exactness test mode), and the result is
returned as fp32. In fp32 the matmul kernel's reduction order may depend on how many rows and
keys share the batch, so a score can move by an ulp with batch composition and, at a near-tie,
flip a pick; batched = alone and chunked = one-shot are therefore exact claims of the float64
mode, where every product of two fp32 (or FP4-rounded) numbers is exact and the fp64 sum's
error is far below fp32 resolution. (Until this change the fp32 path also accumulated in fp64;
fp32 accumulation changes bits of fp32/bf16 runs and is 2-4x cheaper.)

Layout: query rows are regrouped per sequence into a padded [N, S, H, d] tensor so that each
sequence's keys are multiplied once by all of its rows (a batched matmul), instead of copying the
keys once per query row. Rows are processed in blocks of the padded S axis, and each block only
involves the sequences that have rows in it, so intermediates stay near `budget` elements
(a memory bound, not a per-token loop); results do not depend on the block size.
"""

from __future__ import annotations

import torch

from kvshare.step.addresses import SeqRows

DEFAULT_BUDGET = 1 << 25  # elements per intermediate (128 MiB in fp32, 256 MiB in fp64)


def _rank_in_sequence(seq_index: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row's rank within its sequence [T], rows per sequence [N]); rows keep their order."""
    t = seq_index.numel()
    counts = torch.bincount(seq_index, minlength=n)
    order = torch.argsort(seq_index, stable=True)
    first = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(seq_index)
    rank[order] = torch.arange(t, device=seq_index.device) - first[seq_index[order]]
    return rank, counts


def index_scores(
    q: torch.Tensor,  # [T, H, d] index queries (post-RoPE, quantised as configured)
    weights: torch.Tensor,  # [T, H] head weights, already scaled
    keys: torch.Tensor,  # [N, L, d] index keys of each sequence
    seq_index: torch.Tensor,  # [T] sequence of each query row
    budget: int = DEFAULT_BUDGET,
    rows: SeqRows | None = None,
) -> torch.Tensor:
    """[T, L] fp32 scores of every query row against all L key rows of its own sequence.

    `rows` (the step's addresses: host row counts and ranks) spares deriving them from
    `seq_index`, which reads device values on the host."""
    t, h, d = q.shape
    n, length = keys.shape[0], keys.shape[1]
    out = torch.empty(t, length, dtype=torch.float32, device=q.device)
    if t == 0 or length == 0:
        return out
    if rows is not None:
        rank, s_max, host_counts = rows.rank, rows.max_len, rows.lens
    else:
        rank, counts = _rank_in_sequence(seq_index, n)
        s_max, host_counts = int(counts.max()), None
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    q_pad = q.new_zeros((n, s_max, h, d), dtype=acc)
    q_pad[seq_index, rank] = q.to(acc)
    w_pad = weights.new_zeros((n, s_max, h), dtype=acc)
    w_pad[seq_index, rank] = weights.to(acc)
    scores = torch.empty(n, s_max, length, dtype=torch.float32, device=q.device)
    kd_t = keys.to(acc).transpose(1, 2)  # [N, d, L]
    block = max(1, budget // max(1, n * h * max(length, d)))
    for s0 in range(0, s_max, block):
        s1 = min(s_max, s0 + block)
        if host_counts is not None and min(host_counts) > s0:  # every sequence has rows in this block
            qb = q_pad[:, s0:s1].reshape(n, (s1 - s0) * h, d)
            dots = torch.bmm(qb, kd_t).view(n, s1 - s0, h, length)
            scores[:, s0:s1] = torch.einsum("nshl,nsh->nsl", torch.relu(dots), w_pad[:, s0:s1]).float()
            continue
        if host_counts is not None:
            active = torch.tensor([i for i, c in enumerate(host_counts) if c > s0], device=q.device)
        else:
            active = (counts > s0).nonzero().squeeze(1)  # sequences with rows in this block
        na = active.numel()
        qb = q_pad[active, s0:s1].reshape(na, (s1 - s0) * h, d)
        dots = torch.bmm(qb, kd_t[active]).view(na, s1 - s0, h, length)
        summed = torch.einsum("nshl,nsh->nsl", torch.relu(dots), w_pad[active, s0:s1])
        scores[active, s0:s1] = summed.float()
    out[:] = scores[seq_index, rank]
    return out


def _per_row_scores(q: torch.Tensor, w: torch.Tensor, keys_t: torch.Tensor) -> torch.Tensor:
    """[R, L] = sum_h w[r, h] ReLU(q[r, h] . keys_t[r, :, l]) for q [R, H, d], w [R, H], keys_t
    [R, d, L]: two batched products with one row per batch entry, so a row's bits depend on its
    own inputs and L only (ops/invariant.py)."""
    return torch.bmm(w.unsqueeze(1), torch.relu(torch.bmm(q, keys_t))).squeeze(1)


def candidate_scores(
    q: torch.Tensor,  # [T, H, d]
    weights: torch.Tensor,  # [T, H]
    keys: torch.Tensor,  # [N, L, d]
    seq_index: torch.Tensor,  # [T]
    mask: torch.Tensor,  # [T, L] bool: the rows each query row may score (at most `cap` per row)
    cap: int,
) -> torch.Tensor:
    """[T, L] fp32 scores of each query row against only its masked rows; -inf elsewhere.

    Same formula and accumulation dtype as `index_scores`; every query row is one fixed-shape
    product against its own `cap` gathered keys, so a row's scores do not depend on the batch.
    The cost is T x cap x d instead of T x L x d."""
    from kvshare.ops.topk import mask_to_ascending

    t, h, d = q.shape
    length = keys.shape[1]
    out = torch.full((t, length + 1), float("-inf"), dtype=torch.float32, device=q.device)
    if t == 0 or length == 0:
        return out[:, :length]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    idx = mask_to_ascending(mask, cap)  # [T, cap], -1 padded
    valid = idx >= 0
    rows = keys[seq_index[:, None], idx.clamp(min=0)].to(acc)  # [T, cap, d]
    summed = _per_row_scores(q.to(acc), weights.to(acc), rows.transpose(1, 2))  # [T, cap]
    out.scatter_(1, torch.where(valid, idx, torch.full_like(idx, length)), summed.float())
    return out[:, :length]


def row_index_scores(
    q: torch.Tensor,  # [T, H, d]
    weights: torch.Tensor,  # [T, H]
    keys: torch.Tensor,  # [N, L, d] index keys of each sequence
    seq_index: torch.Tensor,  # [T]
    buckets: list[tuple[int, torch.Tensor]],  # [(B, rows)]: rows whose causal count rounds up to B
    budget: int = DEFAULT_BUDGET,
) -> torch.Tensor:
    """[T, L] fp32 scores, batch-invariant (ops/invariant.py): each row of a bucket (B, rows) is
    scored against keys ``[0, B)`` of its sequence in a product of shape [H, d] x [d, B] (one
    batch entry per row), so its bits depend on its own query and keys only. `buckets` come from
    the step's host ints (`StepAddresses.length_buckets`), so nothing is read from the device.
    Columns past a row's bucket are 0; callers mask ``j >= (pos + 1) // ratio`` as for `index_scores`."""
    t, h, d = q.shape
    length = keys.shape[1]
    out = torch.zeros(t, length, dtype=torch.float32, device=q.device)
    if t == 0 or length == 0:
        return out
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    width = max(b for b, _ in buckets)
    kp = keys.to(acc)
    if width > length:
        kp = torch.cat([kp, kp.new_zeros(kp.shape[0], width - length, d)], dim=1)
    qa, wa = q.to(acc), weights.to(acc)
    one_seq = kp.shape[0] == 1
    for b, rows in buckets:
        per = max(1, budget // max(1, b * max(d, h)))  # rows per product: bounds memory only
        for r0 in range(0, rows.numel(), per):
            r = rows[r0:r0 + per]
            if one_seq:  # every row reads the same keys: a stride-0 batch, not G copies (a prefill
                # chunk at 8K context copied 4 GB); each batch entry is the same [H, d] x [d, b] product
                kt = kp[0, :b].t().unsqueeze(0).expand(r.numel(), d, b)
            else:
                kt = kp[seq_index[r], :b].transpose(1, 2)  # [G, d, b]
            summed = _per_row_scores(qa[r], wa[r], kt)  # [G, b]
            out[r, :min(b, length)] = summed[:, :length].float()
    return out
