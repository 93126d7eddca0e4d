"""Tensor-parallel engine end to end: TP=2 (gloo, spawned workers) against TP=1, replica digests,
worker failure, and no process left behind.

Default suite: one TP=2 run of tiny-v41 loaded from a checkpoint (sliced loader; prefix caching on, with
a hit the workers must replay) and one failure
run (each spawn ~3-8 s here). tiny-v4 runs under ``-m slow``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import threading
import time

import pytest
import torch

from kvshare.engine.sampling import SamplingParams
from kvshare.llm import LLM
from kvshare.weights.loader import load_model
from kvshare.weights.checkpoint_write import save_checkpoint
from kvshare.parallel.control import pool_digest
from kvshare.parallel.launch import TPWorkerError

PROMPTS = [[1, 5, 9, 13, 2, 7, 11, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 200, 17, 33], [3, 1, 4, 1, 5, 9, 2, 6],
           [250, 40, 2]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
# Prefix-cache phase: LONG warms the cache (its boundary checkpoint sits at a block boundary: 64 for
# tiny-v41, 128 for tiny-v4), then LONG + TAIL hits there, so the workers replay a ring restore.
LONG = [(37 * i + 11) % 251 for i in range(140)]
TAIL = [5, 77, 19, 203, 8]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes
        return f.read().split(")")[-1].split()[0] != "Z"


def _run(model: str, tp: int) -> tuple[list[list[int]], list[torch.Tensor], LLM, int]:
    """Greedy tokens of PROMPTS, LONG and LONG + TAIL (prefix caching on), every step's logits, the
    engine, and the tokens the last request took from the prefix cache."""
    llm = LLM(model, tensor_parallel_size=tp, quantize=False, dtype="float32", max_num_batched_tokens=16)
    logits: list[torch.Tensor] = []
    run = llm.engine.runner.run

    def record(chunks):
        out, rows = run(chunks)
        logits.append(out.clone())
        return out, rows

    llm.engine.runner.run = record
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    outs += llm.generate([LONG], GREEDY, use_tqdm=False)
    outs += llm.generate([LONG + TAIL], GREEDY, use_tqdm=False)
    return [o.token_ids for o in outs], logits, llm, outs[-1].num_cached_tokens


@pytest.mark.parametrize("name", [pytest.param("tiny-v4", marks=pytest.mark.slow), "tiny-v41",
                                  pytest.param("tiny-v41-engram", marks=pytest.mark.slow)])
def test_tp2_engine_matches_tp1(tmp_path, name: str) -> None:
    ck = save_checkpoint(load_model(name, quant=False), load_model(name).cfg, tmp_path / name)
    want_tokens, want_logits, base, want_hit = _run(str(ck), 1)
    fresh_digest = pool_digest(LLM(str(ck), quantize=False, dtype="float32", max_num_batched_tokens=16).engine.pool)
    got_tokens, got_logits, llm, got_hit = _run(str(ck), 2)
    try:
        assert want_hit == got_hit and got_hit >= 64  # the TP=2 engine caches prefixes and hits like TP=1
        assert got_tokens == want_tokens
        assert len(got_logits) == len(want_logits)  # same schedule (chunked prefill of 16 tokens)
        err = max((g - w).abs().max().item() for g, w in zip(got_logits, want_logits) if w.numel())
        assert err < 1e-5, err  # the bound; observed with the prefix-hit phase 3.3e-6 (v41), 3.9e-6 (v4), 4.3e-6 (engram), |logits| up to 4.3
        digests = llm.engine.tp.digests()
        assert len(digests) == 2 and digests[0] == digests[1]
        assert digests[0] == pool_digest(llm.engine.pool) and digests[0] != fresh_digest
        assert pool_digest(base.engine.pool) != fresh_digest
        pids = [p.pid for p in llm.engine.tp.procs]
    finally:
        llm.engine.shutdown()
    assert not any(_alive(p) for p in pids)
    assert not mp.active_children()


def test_worker_failure_stops_the_engine() -> None:
    llm = LLM("tiny-v41", tensor_parallel_size=2, quantize=False, dtype="float32")
    worker = llm.engine.tp.procs[0]
    assert llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0].token_ids
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(5)
    with pytest.raises(TPWorkerError, match=r"rank 1 exited with code -9.*engine is stopped"):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)
    with pytest.raises(TPWorkerError):  # stays stopped
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)
    time.sleep(0.1)
    assert not mp.active_children()


@pytest.mark.slow
def test_torchrun_runs_the_same_code() -> None:
    """`torchrun --nproc-per-node 2 -m kvshare generate --tp 2` prints what a single process prints."""
    import subprocess
    import sys

    args = ["generate", "--model", "tiny-v41", "--random-weights", "--no-quantize", "--max-tokens", "10",
            "--temperature", "0", "hello"]
    one = subprocess.run([sys.executable, "-m", "kvshare", *args], capture_output=True, text=True, timeout=120)
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "kvshare", *args, "--tp", "2"],
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    assert two.stdout.splitlines()[0] == one.stdout.splitlines()[0]  # the completion; timings differ


SPEC = {"method": "dspark", "num_speculative_tokens": 3}


def test_tp2_speculation_gives_tp2_plain_greedy_tokens() -> None:
    """TP=2 with DSpark speculation (fp32, tiny V4.1 with draft stages, random weights) commits the
    tokens of TP=2 plain greedy decoding: first with the DSpark drafter itself (its draft forward and
    draft-window writes replayed on the worker), then with an oracle drafter that agrees with the
    plain tokens for 2 drafts and then proposes a wrong one (accepted and rejected drafts, rollback
    of blocks). The replicas' pools and draft windows stay identical (digests)."""
    kw = dict(tensor_parallel_size=2, quantize=False, dtype="float32", max_num_batched_tokens=32)
    plain = LLM("tiny-v41-dspark", **kw)
    try:
        want = [o.token_ids for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        plain.engine.shutdown()
    llm = LLM("tiny-v41-dspark", speculative_config=SPEC, **kw)
    try:
        eng = llm.engine
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
        drafted = eng.stats().extra["spec_draft_tokens"]
        assert drafted > 0
        ref = {tuple(p): w for p, w in zip(PROMPTS, want)}

        def oracle(seq, k):  # the plain continuation for 2 drafts, then a token it does not take
            full = ref[tuple(seq.prompt_token_ids)]
            done = len(seq.output_token_ids)
            good = full[done:done + 2]
            return (good + [(full[done + len(good)] + 1) % eng.cfg.vocab_size if done + len(good) < len(full)
                            else 0] * k)[:k]

        eng.speculator.draft_override = oracle
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
        st = eng.stats().extra
        assert st["spec_accepted_tokens"] > 0 and st["spec_draft_tokens"] - drafted > st["spec_accepted_tokens"]
        digests = eng.tp.digests()
        assert digests[0] == digests[1] == pool_digest(eng.pool)
    finally:
        llm.engine.shutdown()


def test_stopped_worker_stops_the_engine_within_the_step_timeout() -> None:
    """A SIGSTOPped worker (issue 28): rank 0 would wait in the step's collective for ever; with
    tp_step_timeout=2 the engine stops with a TPWorkerError naming the rank, and no process is left.
    Observed: refused 2.0-2.3 s after the request. Mutation: the watchdog not entered in `_guard`
    -> the generate call blocks (the test fails after 60 s and kills the worker to unblock it)."""
    llm = LLM("tiny-v41", tensor_parallel_size=2, quantize=False, dtype="float32", tp_step_timeout=2.0)
    worker = llm.engine.tp.procs[0]
    assert llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0].token_ids
    os.kill(worker.pid, signal.SIGSTOP)
    result: list[BaseException | None] = []

    def run() -> None:
        try:
            llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)
            result.append(None)
        except BaseException as e:
            result.append(e)

    t0 = time.monotonic()
    caller = threading.Thread(target=run, daemon=True)
    caller.start()
    caller.join(60)
    if caller.is_alive():  # the watchdog did not fire: unblock rank 0 before failing
        os.kill(worker.pid, signal.SIGKILL)
        caller.join(30)
        pytest.fail("a stopped worker blocked the engine for 60 s")
    err = result[0]
    assert isinstance(err, TPWorkerError), err
    assert re.search(r"rank 1 \(stopped\) made no progress for 2 s.*engine is stopped", str(err)), err
    waited = time.monotonic() - t0
    print(f"refused {waited:.2f} s after the request")
    assert 2.0 <= waited < 10, waited
    worker.join(5)
    assert not _alive(worker.pid)
    assert not mp.active_children()


def test_cli_accepts_tensor_parallelism_and_speculation_together() -> None:
    """`kvshare generate --tp 2 --speculative-config ...` runs and prints the completion a plain
    single-process greedy run prints (fp32: TP=2 greedy tokens equal TP=1's here)."""
    import json
    import subprocess
    import sys

    args = ["generate", "ab", "--model", "tiny-v41-dspark", "--random-weights", "--no-quantize", "--dtype", "float32",
            "--max-tokens", "10", "--temperature", "0", "--ignore-eos"]
    one = subprocess.run([sys.executable, "-m", "kvshare", *args], capture_output=True, text=True, timeout=300)
    both = subprocess.run([sys.executable, "-m", "kvshare", *args, "--tp", "2", "--speculative-config",
                           json.dumps(SPEC)], capture_output=True, text=True, timeout=300)
    assert one.returncode == 0 and both.returncode == 0, both.stderr
    assert "speculation: " in both.stderr and "drafted" in both.stderr
    assert both.stdout.splitlines()[0] == one.stdout.splitlines()[0]


def test_engine_refuses_tensor_parallelism_without_a_started_group() -> None:
    """TP is launched above the engine (`kvshare.llm.build_engine`); the engine alone refuses it."""
    from kvshare.engine.engine import LLMEngine
    from kvshare.errors import SetupError

    with pytest.raises(SetupError, match="build_engine"):
        LLMEngine("tiny-v41", tensor_parallel_size=2)
