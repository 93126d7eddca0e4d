"""Starting, watching and stopping the tensor-parallel ranks of one engine.

`start(model, args)` is called above the engine (`kvshare.llm.build_engine`, used by `LLM` and the
CLI) when ``args.tensor_parallel_size > 1``; the engine then gets the handle and rank 0's shard:
- started normally (one process): it spawns ranks 1..N-1 on this machine (``mp`` spawn, a free
  port for the rendezvous, each worker pinned to this process's intra-op thread count), joins the
  group as rank 0 and returns (`TPHandle`, rank 0's shard);
- started by torchrun: every process joins the group from torchrun's environment; rank 0 returns
  like above, the others build their engine, serve rank 0's steps and exit when it stops.

Failure: a worker that raises reports its traceback and exits; rank 0's next collective fails and
`TPHandle` raises `TPWorkerError` naming the rank, then stops the remaining workers (the engine is
unusable afterwards). A worker that makes no progress for `tp_step_timeout` seconds while rank 0
waits in a step (SIGSTOP, a hung kernel) is treated the same way: the watchdog kills the spawned
workers, which fails rank 0's pending collective, and the error names the stopped ranks. A worker whose parent process is gone exits within a second. Workers ignore
Ctrl-C (the terminal sends it to the whole process group); rank 0 stops them when it exits.
"""

from __future__ import annotations

import atexit
import dataclasses
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
import traceback
from typing import Any

import torch

from kvshare.config import load_config
from kvshare.errors import KVShareError
from kvshare.parallel import control
from kvshare.parallel.group import TPGroup, destroy_group, free_port, init_group, launched_by_torchrun
from kvshare.parallel.loader import load_rank_model, resolve_model
from kvshare.parallel.shard import check_divisible
from kvshare.parallel.tp_executor import TPExecutor
from kvshare.engine.engine import LLMEngine

JOIN_TIMEOUT_S = 10.0


class TPWorkerError(KVShareError, RuntimeError):
    """A tensor-parallel worker failed or exited; the engine is stopped (no request is at fault)."""

    engine_fatal = True


class TPHandle:
    """Rank 0's handle on the group: sends steps, gathers digests, detects failures, stops workers."""

    def __init__(self, group: TPGroup, procs: list[Any], errors: Any, step_timeout_s: float = 60.0) -> None:
        self.group = group
        self.procs = procs
        self.errors = errors
        self.failed: TPWorkerError | None = None
        self.closed = False
        self.watchdog = control.StepWatchdog(step_timeout_s, self._stalled)
        self._stopped_ranks: list[int] = []
        atexit.register(self.close)

    def executor(self, runner: Any, pool: Any, draft: Any = None, windows: Any = None) -> Any:
        """Rank 0's executor: every operation is broadcast to the workers, then run here
        (parallel/tp_executor.py)."""
        self.pool = pool
        return TPExecutor(self, runner, pool, draft, windows)

    def guard(self, fn: Any, *a: Any) -> Any:
        """``fn(*a)``; any failure stops the group and raises `TPWorkerError` (engine_fatal)."""
        return self._guard(fn, *a)

    def _guard(self, fn: Any, *a: Any) -> Any:
        if self.failed is not None:
            raise self.failed
        if self.closed:
            raise TPWorkerError("the tensor-parallel group is closed")
        try:
            with self.watchdog:
                return fn(*a)
        except Exception as e:
            self.failed = self._diagnose(e)
            self.close()
            raise self.failed from e

    def _diagnose(self, e: Exception) -> TPWorkerError:
        time.sleep(0.2)  # let a dying worker's report and exit code land
        reports = []
        while True:
            try:
                reports.append(self.errors.get_nowait())
            except (queue.Empty, OSError, ValueError):
                break
        dead = [f"rank {i + 1} exited with code {p.exitcode}" for i, p in enumerate(self.procs)
                if p.exitcode is not None]
        what = "; ".join(dead) or f"a collective failed ({type(e).__name__}: {e})"
        if self.watchdog.stalled_s is not None:
            who = ", ".join(f"rank {r}" for r in self._stopped_ranks) or "a worker"
            state = " (stopped)" if self._stopped_ranks else ""
            what = (f"{who}{state} made no progress for {self.watchdog.stalled_s:g} s (--tp-step-timeout); "
                    "every worker was killed")
        detail = ("\n" + "\n".join(reports)) if reports else ""
        return TPWorkerError(f"tensor-parallel worker failure: {what}; the engine is stopped{detail}")

    def _stalled(self) -> None:
        """The watchdog fired: note which workers are stopped, then kill every worker, which fails
        rank 0's pending collective (gloo sees the closed connections)."""
        self._stopped_ranks = [i + 1 for i, p in enumerate(self.procs) if _process_state(p.pid) == "T"]
        for p in self.procs:
            if p.is_alive():
                p.kill()

    def digests(self) -> list[str]:
        """SHA-256 of every rank's block pool and rings, in rank order (replicas must agree)."""
        self._guard(control.send, control.DIGEST)
        return self._guard(control.gather_digests, self.pool, self.group.size)

    def close(self) -> None:
        """Stop the workers (politely, then by signal), leave the group. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.watchdog.close()
        if self.failed is None:
            try:
                control.send(control.STOP)
            except Exception:  # a worker already gone: fall through to termination
                pass
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join()
        destroy_group()


def _process_state(pid: int | None) -> str | None:
    """The state letter of process `pid` from /proc (``T``: stopped), None when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError, TypeError):
        return None


def _watch_parent() -> None:
    """Exit this worker as soon as its parent process is gone (no orphans after a crash)."""
    parent = mp.parent_process()

    def watch() -> None:
        while parent is not None and parent.is_alive():
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _worker_main(rank: int, size: int, init_method: str, model: Any, args: Any, threads: int,
                 errors: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch_parent()
    torch.set_num_threads(threads)
    try:
        group = init_group(rank, size, init_method, device=args.device)
        _serve(group, model, args)
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        sys.exit(1)
    destroy_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: gloo's threads can abort it ("terminate called ...")


def _serve(group: TPGroup, model: Any, args: Any) -> None:
    """A worker's life: load its shard, build its engine (same arguments), replay rank 0's steps."""
    shard = load_rank_model(model, args, group)
    # Rank 0 alone keeps the prefix cache (its restores come as slot operations).
    engine = LLMEngine(shard, None, args=dataclasses.replace(args, tensor_parallel_size=1,
                                                             enable_prefix_caching=False))
    control.worker_loop(engine.executor, group.size)


def start(model: Any, args: Any) -> tuple[TPHandle | None, Any]:
    """Start the group for an engine (see module doc): (rank 0's handle, rank 0's shard)."""
    size = args.tensor_parallel_size
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if isinstance(model, (str, type(None))):  # refuse an indivisible config before spawning anything
        check_divisible(load_config(str(resolve_model(model or "kvshare-mini-v41"))), size)
    if launched_by_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world != size:
            raise ValueError(f"torchrun started {world} processes but tensor_parallel_size is {size}")
        group = init_group(rank, size, device=args.device)
        if rank != 0:
            try:
                _serve(group, model, args)
            finally:
                destroy_group()
            sys.exit(0)
        return TPHandle(group, [], queue.Queue(), _step_timeout(args)), load_rank_model(model, args, group)
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    threads = torch.get_num_threads()
    procs = [ctx.Process(target=_worker_main, args=(r, size, init_method, model, args, threads, errors),
                         daemon=True, name=f"kvshare-tp{r}") for r in range(1, size)]
    for p in procs:
        p.start()
    try:
        group = init_group(0, size, init_method, device=args.device)
    except BaseException:
        for p in procs:
            p.kill()
            p.join()
        raise
    handle = TPHandle(group, procs, errors, _step_timeout(args))
    try:
        return handle, load_rank_model(model, args, group)
    except BaseException:
        handle.failed = TPWorkerError("rank 0 failed to load its shard")
        handle.close()
        raise


def _step_timeout(args: Any) -> float:
    return float(getattr(args, "tp_step_timeout", None) or 60.0)
