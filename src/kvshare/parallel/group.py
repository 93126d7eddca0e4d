"""The tensor-parallel process group: set-up, the two collectives the model needs, tear-down.

`TPGroup(rank, size)` is what sharded modules hold. Its collectives are the only communication in
a forward step: `all_reduce` (sum, in fp32 or wider, cast back to the input dtype) after the
row-parallel `wo_b`, the expert-parallel routed sum and the vocab-parallel embedding, and
`all_gather` of the vocab-parallel head's logits (concatenated along the last dim, rank order).

Backend: NCCL when CUDA is available, else gloo. The rendezvous address is ``tcp://HOST:PORT`` with
a port picked free at run time (`free_port`), or torchrun's environment (``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``) when launched by torchrun.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Workers wait on rank 0 between steps for as long as a server is idle; a dead peer closes the
# TCP connection and fails the collective at once, so the timeout only bounds a hung peer.
IDLE_TIMEOUT = datetime.timedelta(days=7)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def default_backend(device: torch.device | str | None = None) -> str:
    """'nccl' for a CUDA device (or CUDA available and no device given), else 'gloo'."""
    if device is not None:
        return "nccl" if torch.device(device).type == "cuda" else "gloo"
    return "nccl" if torch.cuda.is_available() else "gloo"


def launched_by_torchrun() -> bool:
    """Whether this process was started by torchrun (its rendezvous variables are set)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                   and "MASTER_PORT" in os.environ)


@dataclass(frozen=True)
class TPGroup:
    """One rank's view of the tensor-parallel group (the default process group)."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over ranks, reduced in fp32 (or wider) and returned in `x`'s dtype."""
        dtype = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
        wide = x.to(dtype, memory_format=torch.contiguous_format, copy=True)
        dist.all_reduce(wide)
        return wide.to(x.dtype)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` concatenated along the last dim, in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


def init_group(rank: int, size: int, init_method: str | None = None, backend: str | None = None,
               device: torch.device | str | None = None) -> TPGroup:
    """Join the default process group as `rank` of `size`; `init_method` None reads torchrun's env."""
    backend = backend or default_backend(device)
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device) if device is not None else rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=init_method or "env://", rank=rank, world_size=size,
                            timeout=IDLE_TIMEOUT)
    return TPGroup(rank, size)


def destroy_group() -> None:
    """Leave the default process group if this process is in one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
