"""Prefix cache bookkeeping: hashing, salt isolation, collisions, LRU eviction, cascade, budget,
reference counts, checkpoint bytes against the plan, and the block-size rule."""

from __future__ import annotations

import random

import pytest
import torch

import kvshare.cache.prefix as prefix_mod
from kvshare.cache.blocks import BlockAllocator
from kvshare.cache.prefix import Checkpoint, PrefixCache, block_hash
from kvshare.config import load_config
from kvshare.engine.engine import LLMEngine
from kvshare.engine.sampling import SamplingParams
from kvshare.errors import ConfigError
from kvshare.model.deepseek import Transformer

B = 8


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer(load_config("tiny-v41"), quant=False).init_weights(5).eval()


def engine(model, **kw) -> LLMEngine:
    kw = {"block_size": B, "num_blocks": 16, "max_num_seqs": 2, "max_num_batched_tokens": 256, **kw}
    return LLMEngine(model, **kw)


def run(eng: LLMEngine, prompt: list[int], salt: str | None = None, n: int = 3, rid: str = "r"):
    eng.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), cache_salt=salt)
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
    assert eng.blocks.allocator.num_used == 0  # reference counts back to zero after every request
    return out


def prompt(seed: int, n: int = 4 * B + 3) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


# ---- hashing -----------------------------------------------------------------------------------
def test_chained_hash_depends_on_parent_tokens_key_and_salt():
    key = prefix_mod.prefix_key("m", 8)
    base = block_hash(None, [1, 2, 3], key, None)
    assert base == block_hash(None, [1, 2, 3], key, None)
    others = [block_hash(base, [1, 2, 3], key, None), block_hash(None, [1, 2, 4], key, None),
              block_hash(None, [1, 2, 3], prefix_mod.prefix_key("m", 16), None),
              block_hash(None, [1, 2, 3], key, "tenant-a"), block_hash(None, [1, 2, 3], key, "")]
    assert len({base, *others}) == 1 + len(others)


# ---- allocator LRU -----------------------------------------------------------------------------
def test_freed_cached_blocks_are_reclaimed_least_recently_released_first():
    a = BlockAllocator(6)  # blocks 1..5
    cached = {1, 2, 3}
    evicted: list[int] = []
    a.is_cached, a.on_evict = cached.__contains__, evicted.append
    x = a.allocate(5)
    assert x == [1, 2, 3, 4, 5]
    a.free([3, 1])
    a.free([2, 4, 5])  # 4 and 5 are not cached: plain free blocks, handed out before any eviction
    assert a.num_free == 5 and a.num_evictable == 3 and a.evictable() == [3, 1, 2]
    a.acquire(1)  # a hit takes block 1 back out of the LRU
    assert a.refcount(1) == 1 and a.evictable() == [3, 2]
    assert sorted(a.allocate(2)) == [4, 5] and evicted == []
    assert a.allocate(1) == [3] and evicted == [3]
    a.free([1])
    assert a.evictable() == [2, 1]
    a.free([4])
    with pytest.raises(ValueError):
        a.acquire(4)  # a free block that holds no cached prefix cannot be "hit"


# ---- checkpoint store --------------------------------------------------------------------------
def _ck(chain: list[bytes], nbytes: int) -> Checkpoint:
    return Checkpoint(len(chain) * B, tuple(chain), {("window", 0): (8, 4, torch.zeros(nbytes, dtype=torch.uint8))})


def test_checkpoint_budget_lru_and_cascade():
    c = PrefixCache(B, b"k", checkpoint_budget=200)
    hs = c.hashes(list(range(4 * B)), [], 4, None)
    for k, h in enumerate(hs):
        assert c.register(h, 10 + k, list(range(k * B, (k + 1) * B)))
    assert not c.register(hs[0], 99, list(range(B)))  # one cached copy per hash
    for k in range(3):
        assert c.insert_checkpoint(_ck(hs[:k + 1], 80))  # third insert evicts the oldest (depth 1)
    assert list(c.checkpoints) == [hs[1], hs[2]] and c.checkpoint_bytes == 160
    m = c.lookup(list(range(4 * B)), hs, 4 * B)
    assert (m.boundary, m.block_depth, m.blocks) == (3 * B, 4 * B, [10, 11, 12])
    assert c.lookup(list(range(4 * B)), hs, 2 * B).boundary == 2 * B  # capped below the deepest
    assert c.insert_checkpoint(_ck(hs[:4], 80))  # evicts depth 3: the lookup capped at 2 B used depth 2 last
    assert list(c.checkpoints) == [hs[1], hs[3]]
    c.drop_block(11)  # block 2 of the chain goes: both checkpoints run through it
    assert not c.checkpoints and c.checkpoint_bytes == 0
    assert c.lookup(list(range(4 * B)), hs, 4 * B).boundary == 0
    assert not c.insert_checkpoint(_ck(hs[:3], 8))  # a chain block is missing: refused
    assert not c.insert_checkpoint(_ck(hs[:2], 500))  # larger than the whole budget


# ---- engine ------------------------------------------------------------------------------------
def test_salts_never_share(model):
    eng = engine(model)
    p = prompt(1)
    run(eng, p, salt="a")
    assert run(eng, p, salt="b").num_cached_tokens == 0
    assert run(eng, p, salt=None).num_cached_tokens == 0
    assert run(eng, p, salt="a").num_cached_tokens == 4 * B


def test_injected_hash_collision_is_rejected_by_the_token_check(model, monkeypatch):
    """Every block of every prompt hashes alike: only the token comparison keeps prompts apart."""
    real = prefix_mod.block_hash
    monkeypatch.setattr(prefix_mod, "block_hash", lambda parent, tokens, key, salt: real(parent, [0], key, salt))
    eng = engine(model)
    p, q = prompt(1), prompt(2)
    run(eng, p)
    out = run(eng, q)
    assert out.num_cached_tokens == 0
    cold = run(engine(model, enable_prefix_caching=False), q)
    assert out.token_ids == cold.token_ids
    assert run(eng, p).num_cached_tokens == 4 * B  # the true owner of the hash still hits


def test_salts_never_share_even_when_hashes_collide(model, monkeypatch):
    real = prefix_mod.block_hash
    monkeypatch.setattr(prefix_mod, "block_hash", lambda parent, tokens, key, salt: real(parent, tokens, key, None))
    eng = engine(model)
    p = prompt(1)
    run(eng, p, salt="a")
    assert run(eng, p, salt="b").num_cached_tokens == 0
    assert run(eng, p, salt="a").num_cached_tokens == 4 * B


def test_lru_reclaims_the_oldest_prefix_and_keeps_the_recent_one(model):
    eng = engine(model, num_blocks=12)  # 11 usable blocks; a request needs 5 (35 prompt + 3 tokens), 4 full
    p1, p2, p3 = prompt(1), prompt(2), prompt(3)
    run(eng, p1, rid="1")
    run(eng, p2, rid="2")
    assert eng.blocks.allocator.num_evictable == 8
    cache = eng.prefix.cache
    lru = eng.blocks.allocator.evictable()
    h1, h2 = (cache.hashes(p, [], 4, None) for p in (p1, p2))
    assert [cache.hash_of_block[b] for b in lru] == h1[::-1] + h2[::-1]  # released tail first, p1 before p2
    run(eng, p3, rid="3")  # 3 free blocks, then 2 reclaimed: p1's last two full blocks go first
    assert cache.stats.blocks_evicted == 2
    still = [cache.hash_of_block.get(b) == h for b, h in zip(lru, h1[::-1] + h2[::-1])]
    assert still == [False, False] + [True] * 6
    assert run(eng, p2, rid="2b").num_cached_tokens == 4 * B
    assert run(eng, p1, rid="1b").num_cached_tokens == 0  # its checkpoints fell with its blocks


def test_concurrent_requests_share_blocks_and_release_them(model):
    eng = engine(model)
    p = prompt(1)
    run(eng, p)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    eng.add_request("x", p + [5], params)
    eng.add_request("y", p + [6], params)
    eng.step()
    xs, ys = (eng.blocks.block_ids[eng.requests[r].slot] for r in "xy")
    assert xs[:4] == ys[:4] and all(eng.blocks.allocator.refcount(b) == 2 for b in xs[:4])
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.blocks.allocator.num_used == 0


def test_checkpoint_bytes_equal_the_plan_and_pool_bytes_equal_the_layout(model):
    from argparse import Namespace

    from kvshare.cli.plan import build_plan

    eng = engine(model)
    run(eng, prompt(1))
    (ck, *_) = eng.prefix.cache.checkpoints.values()
    plan = build_plan(Namespace(config="tiny-v41", block_size=B, kv_format="fp32", index_format="fp32",
                                window_format="fp32", memory=None, max_seqs=1, no_share=False, json=True))
    # by hand: 6 layers x (W - 1 = 7) window rows x 16 fp32 = 64 B; the ratio-2 compressors keep nothing
    assert ck.nbytes == plan["prefix_checkpoint"]["bytes_per_boundary"] == 6 * 7 * 64
    assert eng.pool.block_bytes == eng.pool.num_blocks * plan["layout"]["bytes_per_block"]


def test_block_size_must_be_a_multiple_of_every_ratio(model):
    with pytest.raises(ConfigError, match="block_size"):
        engine(model, block_size=7)
    v4 = Transformer(load_config("tiny-v4")).init_weights(1)
    with pytest.raises(ConfigError, match="block_size"):
        engine(v4, block_size=64)  # lcm(4, 128) = 128


def test_caching_off_takes_no_checkpoints(model):
    eng = engine(model, enable_prefix_caching=False)
    p = prompt(1)
    run(eng, p)
    assert eng.prefix is None and eng.backend.capture is None
    assert run(eng, p).num_cached_tokens == 0 and eng.blocks.allocator.num_evictable == 0


def test_cli_flag_turns_caching_off():
    import argparse

    from kvshare.cli.engine_args import add_engine_args, engine_args_from

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_args_from(p.parse_args(["--no-enable-prefix-caching"]))["enable_prefix_caching"] is False
    assert "enable_prefix_caching" not in engine_args_from(p.parse_args([]))  # the engine default: on


def test_abort_and_preemption_leave_a_checkpoint(model):
    eng = engine(model)
    p = prompt(1, 2 * B + 3)
    eng.add_request("a", p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for _ in range(8):  # prefill (19 computed: checkpoint at 16), then 7 decodes: 26 computed
        eng.step()
    eng.abort_request("a")
    eng.step()
    depths = sorted(ck.boundary for ck in eng.prefix.cache.checkpoints.values())
    assert depths == [2 * B, 3 * B]  # prompt end, and the abort at 26 computed
    seq_tokens = p + run(engine(model, enable_prefix_caching=False), p, n=7).token_ids
    assert run(eng, seq_tokens + [1]).num_cached_tokens == 3 * B

    # a pool too small for two sequences: the newer one is preempted, and its recompute hits
    small = engine(model, num_blocks=7)  # 6 usable blocks; each request grows to 5
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    small.add_request("x", prompt(2, 3 * B - 2), params)
    small.add_request("y", prompt(3, 3 * B - 2), params)
    outs = {}
    while small.has_unfinished_requests():
        outs.update({o.request_id: o for o in small.step() if o.finished})
    st = small.stats()
    assert st.num_preemptions > 0 and st.prefix_cache_hit_tokens > 0
    ref = engine(model, enable_prefix_caching=False, num_blocks=40)
    for rid, seed in (("x", 2), ("y", 3)):
        assert outs[rid].token_ids == run(ref, prompt(seed, 3 * B - 2), n=14, rid=rid).token_ids


def test_a_shared_prefix_junction_gets_its_own_checkpoint(model):
    """A's checkpoints sit at its prompt end (5 B) and finish; B shares only 3 B with A, so it finds
    blocks but no checkpoint there: it computes everything and checkpoints the junction at 3 B,
    where C then hits."""
    eng = engine(model)
    shared = prompt(1, 3 * B)
    a, b, c = (shared + prompt(s, 2 * B + 3) for s in (2, 3, 4))
    assert run(eng, a, rid="a").num_cached_tokens == 0
    assert run(eng, b, rid="b").num_cached_tokens == 0
    out = run(eng, c, rid="c")
    assert out.num_cached_tokens == 3 * B
    assert out.token_ids == run(engine(model, enable_prefix_caching=False), c).token_ids


def test_a_failed_batched_forward_leaves_no_capture_and_outputs_stay_exact(model):
    """engine/isolation.py reruns a failed batch one request at a time: the failed forward's capture is
    dropped, the requeued requests recompute (hitting their own checkpoints) and match a clean run."""
    eng = engine(model)
    prompts = [prompt(s, 3 * B + 1) for s in (1, 2)]
    run_real, calls = eng.runner.run, []

    def flaky(chunks):
        calls.append(len(chunks))
        if len(calls) == 3:  # the third forward (both requests decoding, batched) fails half-way
            raise RuntimeError("injected")
        return run_real(chunks)

    eng.runner.run = flaky
    params = SamplingParams(temperature=0, max_tokens=B + 2, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert calls[2] == 2 and eng.prefix.cache.stats.hit_tokens == 2 * 3 * B  # both recomputes hit at 3 B
    assert eng.blocks.allocator.num_used == 0
    ref = engine(model, enable_prefix_caching=False)
    for i, p in enumerate(prompts):
        assert outs[str(i)].token_ids == run(ref, p, n=B + 2, rid=str(i)).token_ids


def test_plan_checkpoint_bytes_for_the_released_configs():
    """By hand (spec/cache.md row sizes): V4.1-Flash keeps W - 1 = 127 window rows of 528 B in each of
    its 40 layers and nothing of its ratio-1/2 compressors; V4-Flash keeps 127 window rows of 584 B in
    43 layers plus, in each of its 21 ratio-4 layers, 4 carry rows of (kv, score) x 2 x 512 fp32 for
    the compressor and of (kv, score) x 2 x 128 fp32 for the indexer's compressor."""
    from argparse import Namespace

    from kvshare.cli.plan import build_plan

    def plan(name: str, bs: int) -> dict:
        return build_plan(Namespace(config=name, block_size=bs, kv_format=None, index_format=None,
                                    window_format=None, memory=None, max_seqs=1, no_share=False, json=True))

    v41 = plan("deepseek-v4.1-flash", 64)["prefix_checkpoint"]
    assert v41["bytes_per_boundary"] == 40 * 127 * 528 == 2_682_240
    v4 = plan("deepseek-v4-flash", 128)["prefix_checkpoint"]
    assert v4["by_ring"] == {"window": 43 * 127 * 584, "compressor": 21 * 4 * 2 * 2 * 512 * 4,
                             "indexer_compressor": 21 * 4 * 2 * 2 * 128 * 4}
    assert v4["bytes_per_boundary_with_draft"] == v4["bytes_per_boundary"] + 127 * 584  # one MTP layer
