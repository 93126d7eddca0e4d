"""Helpers for the tensor-parallel tests: a 2-rank gloo run and its in-process counterpart.

`ThreadHub` runs every rank's shard in one process, one thread per rank, with an in-memory
"all-reduce" that adds the ranks' fp32 partials in rank order (the in-process split-and-sum) and an
"all-gather" that concatenates them. `record_forward` runs one prefill of a model over a fresh
DenseCache and keeps the output of every sharded module (embedding, each attention and MoE, head).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from kvshare.cache.dense import DenseCache
from kvshare.weights.loader import load_model
from kvshare.parallel.group import TPGroup
from kvshare.parallel.shard import apply_tp
from kvshare.step import StepBatch

PROMPT = [7, 200, 31, 4, 99, 18, 250, 3, 64, 1, 129, 77, 12, 190, 45, 6, 222, 90, 33, 8]


class ThreadHub:
    """Rendezvous of `size` threads; each reduction adds the partials in rank order."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size)
        self.slots: list[torch.Tensor | None] = [None] * size

    def _exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = x
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()  # every rank has read before anyone overwrites
        return parts

    def all_reduce(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        wide = x.to(x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32)
        parts = self._exchange(rank, wide)
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return total.to(x.dtype)

    def all_gather(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._exchange(rank, x), dim=-1)


class ThreadGroup:
    def __init__(self, rank: int, hub: ThreadHub) -> None:
        self.rank, self.size, self.hub = rank, hub.size, hub

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.hub.all_reduce(self.rank, x)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return self.hub.all_gather(self.rank, x)


def tiny(name: str) -> torch.nn.Module:
    return load_model(name, dtype=torch.float32, quant=False)


@torch.inference_mode()
def record_forward(model: torch.nn.Module, prompt: list[int] = PROMPT) -> dict[str, torch.Tensor]:
    """Outputs of the sharded modules and the logits of one prefill over a fresh cache."""
    out: dict[str, torch.Tensor] = {}
    mods = {"embed": model.embed, "head": model.head}
    for i, block in enumerate(model.layers):
        mods[f"layers.{i}.attn"] = block.attn
        mods[f"layers.{i}.ffn"] = block.ffn
    hooks = [m.register_forward_hook(lambda _m, _i, o, k=k: out.__setitem__(k, o.clone()))
             for k, m in mods.items()]
    try:
        ids = torch.tensor(prompt)
        batch = StepBatch.build([0], [len(prompt)])
        out["logits"] = model(ids, batch, DenseCache(model.cfg, model.topo, 1, len(prompt))).clone()
    finally:
        for h in hooks:
            h.remove()
    return out


def run_ranks(size: int, fn: Callable[[ThreadGroup], Any]) -> list[Any]:
    """``fn(group)`` of every rank of one `ThreadHub`, the ranks as threads of this process (1 intra-op
    thread each); a rank's exception is raised here after releasing the others."""
    hub = ThreadHub(size)
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        torch.set_num_threads(1)  # per OS thread: must equal the gloo ranks' count for equal bits
        try:
            results[rank] = fn(ThreadGroup(rank, hub))
        except BaseException as e:  # surface in the test, and release the others
            errors.append(e)
            hub.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def threads_tp(name: str, size: int) -> list[dict[str, torch.Tensor]]:
    """`record_forward` of every rank's shard, the ranks as threads of this process."""
    return run_ranks(size, lambda group: record_forward(apply_tp(tiny(name), group)))


def gloo_rank(rank: int, size: int, init_method: str, names: list[str], out_dir: str) -> None:
    """One spawned rank: shard each tiny model, record a prefill, save to out_dir/<name>.rank<r>.pt."""
    torch.set_num_threads(1)
    os.environ.pop("OMP_NUM_THREADS", None)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size)
    try:
        for name in names:
            rec = record_forward(apply_tp(tiny(name), TPGroup(rank, size)))
            torch.save(rec, Path(out_dir) / f"{name}.rank{rank}.pt")  # files, not queues (B.3)
    finally:
        dist.destroy_process_group()
