"""Scheduler: token budget, chunked prefill, decode batching, preemption, cleanup."""

import random

from kvshare.cache.blocks import BlockManager
from kvshare.engine.sampling import SamplingParams
from kvshare.engine.scheduler import Scheduler
from kvshare.engine.sequence import Sequence, SequenceStatus


def _seq(i: int, n: int, max_tokens: int = 4) -> Sequence:
    return Sequence(f"r{i}", None, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), i)


def _run_step(sched: Scheduler, out) -> None:
    """Pretend the model ran: advance, sample a token at chunk ends, finish at max_tokens."""
    for c in out.chunks:
        s = c.seq
        assert c.start == s.num_computed and c.length >= 1
        s.num_computed += c.length
        if c.samples:
            s.append_token(7, 0.0)
            if len(s.output_token_ids) >= s.params.max_tokens:
                sched.finish(s, SequenceStatus.FINISHED_LENGTH)


def test_budget_chunking_and_decode_batching():
    bm = BlockManager(num_blocks=64, block_size=4, num_slots=8, max_model_len=64)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10)
    a, b = _seq(0, 13), _seq(1, 3)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(c.seq.request_id, c.start, c.length) for c in out.chunks] == [("r0", 0, 10)]
    assert not out.chunks[0].samples
    _run_step(sched, out)
    out = sched.schedule()  # r0 finishes its prompt (3), r1 prefills (3)
    assert [(c.seq.request_id, c.start, c.length, c.samples) for c in out.chunks] == [
        ("r0", 10, 3, True), ("r1", 0, 3, True)]
    _run_step(sched, out)
    out = sched.schedule()  # both decode one token each
    assert [(c.seq.request_id, c.length) for c in out.chunks] == [("r0", 1), ("r1", 1)]
    assert out.num_tokens <= sched.max_num_batched_tokens


def test_max_num_seqs_limits_admission():
    bm = BlockManager(num_blocks=64, block_size=4, num_slots=2, max_model_len=64)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(4):
        sched.add(_seq(i, 3))
    out = sched.schedule()
    assert [c.seq.request_id for c in out.chunks] == ["r0", "r1"]
    assert len(sched.waiting) == 2


def test_preemption_frees_blocks_and_requeues_for_recompute():
    bm = BlockManager(num_blocks=5, block_size=4, num_slots=4, max_model_len=16)  # 4 usable blocks
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = _seq(0, 8, max_tokens=6), _seq(1, 8, max_tokens=6)
    sched.add(a)
    sched.add(b)
    _run_step(sched, sched.schedule())  # both prefilled: 2 blocks each, pool full
    assert bm.allocator.num_free == 0 and len(a.output_token_ids) == 1
    out = sched.schedule()  # a decodes token 9 -> needs a 3rd block -> b (newest) is preempted
    assert out.preempted == [b]
    assert b.status is SequenceStatus.WAITING and b.num_computed == 0 and b.slot is None
    assert b.metrics.num_preemptions == 1 and sched.waiting == [b]
    assert [c.seq.request_id for c in out.chunks] == ["r0"]
    _run_step(sched, out)
    while a.status is SequenceStatus.RUNNING:
        _run_step(sched, sched.schedule())
    assert a.finish_reason == "length"
    out = sched.schedule()  # b recomputes prompt + its generated token
    assert [(c.seq.request_id, c.start, c.length, c.samples) for c in out.chunks] == [("r1", 0, 9, True)]


def test_preemption_takes_the_newest_running_sequence_first():
    """Three running sequences fill the pool; the oldest needs a block: the newest (not the
    second-newest) is preempted, and the other two keep their chunks."""
    bm = BlockManager(num_blocks=7, block_size=4, num_slots=4, max_model_len=16)  # 6 usable blocks
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b, c = _seq(0, 8, max_tokens=6), _seq(1, 8, max_tokens=6), _seq(2, 8, max_tokens=6)
    for s in (a, b, c):
        sched.add(s)
    _run_step(sched, sched.schedule())  # all prefilled: 2 blocks each, pool full
    assert bm.allocator.num_free == 0
    out = sched.schedule()  # a needs a 3rd block: c goes (2 blocks back), then b fits too
    assert out.preempted == [c] and c.status is SequenceStatus.WAITING
    assert [(x.seq.request_id, x.start, x.length) for x in out.chunks] == [("r0", 8, 1), ("r1", 8, 1)]


def test_abort_and_cleanup_return_every_block_and_slot():
    bm = BlockManager(num_blocks=10, block_size=4, num_slots=3, max_model_len=32)
    sched = Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=7)
    seqs = [_seq(i, 5 + i) for i in range(5)]
    for s in seqs:
        sched.add(s)
    _run_step(sched, sched.schedule())
    assert sched.abort("r0") is seqs[0] and seqs[0].finish_reason == "abort"
    assert sched.abort("r4") is seqs[4]  # still waiting
    assert sched.abort("nope") is None
    while sched.has_unfinished():
        _run_step(sched, sched.schedule())
    assert bm.allocator.num_free == 9 and bm.slots.num_free == 3 and not bm.block_ids


def test_random_workload_invariants():
    rng = random.Random(0)
    for trial in range(20):
        bm = BlockManager(num_blocks=rng.randint(6, 20), block_size=rng.choice([2, 4, 8]),
                          num_slots=rng.randint(1, 5), max_model_len=40)
        usable_tokens = (bm.allocator.num_usable) * bm.block_size
        sched = Scheduler(bm, max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=rng.randint(1, 24),
                          chunked_prefill=True)
        seqs = []
        for i in range(rng.randint(1, 8)):
            n = rng.randint(1, 20)
            mt = rng.randint(1, 10)
            if n + mt > min(40, usable_tokens):
                continue
            seqs.append(_seq(i, n, mt))
            sched.add(seqs[-1])
        steps = 0
        while sched.has_unfinished():
            out = sched.schedule()
            assert out.chunks, "a step with work pending must schedule something"
            assert out.num_tokens <= sched.max_num_batched_tokens
            assert len({id(c.seq) for c in out.chunks}) == len(out.chunks)
            for c in out.chunks:
                assert len(bm.block_ids[c.seq.slot]) * bm.block_size >= c.start + c.length
            used = [b for ids in bm.block_ids.values() for b in ids]
            assert len(used) == len(set(used)) and 0 not in used
            _run_step(sched, out)
            steps += 1
            assert steps < 2000
        assert all(s.finish_reason == "length" and len(s.output_token_ids) == s.params.max_tokens for s in seqs)
        assert bm.allocator.num_free == bm.allocator.num_usable
