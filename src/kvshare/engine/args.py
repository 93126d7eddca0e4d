"""EngineArgs and how they resolve against a model: device, dtype, row formats, pool size.

Defaults: ``dtype`` None = bf16 on every device (fp32 / float64 on request, for oracle tests; see
`kvshare.model.dtypes` for what stays fp32); ``quantize`` None = keep the model's own fake-quant
setting; the cache arguments (``block_size``, ``kv_format``, ``num_blocks``, ``gpu_memory_bytes``,
``max_model_len``, ``prefix_checkpoint_bytes``) resolve in `engine.cache_plan`;
``engram_table`` "mmap" = Engram tables memory-mapped from the checkpoint (resident memory stays
small; rows come from the page cache), "memory" = read into RAM at load (fastest lookups);
``threads`` None = `resolve_threads`; ``enable_prefix_caching`` True = exact prefix caching
(``engine/prefix_caching.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvshare.errors import SetupError
from kvshare.layers import KernelChoice, switches

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64, "fp64": torch.float64}


@dataclass
class EngineArgs:
    block_size: int | None = None
    kv_format: str | tuple[str, str, str] = "auto"
    gpu_memory_bytes: int | None = None
    num_blocks: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    dtype: str | torch.dtype | None = None
    device: str | torch.device | None = None
    share_kv_cache: bool = True
    quantize: bool | None = None
    seed: int | None = None
    chunked_prefill: bool = True
    engram_table: str = "mmap"
    speculative_config: dict | str | None = None  # {"method": "dspark", "num_speculative_tokens": 5}
    tensor_parallel_size: int = 1
    tp_step_timeout: float = 60.0  # seconds rank 0 waits inside one step before declaring a worker stuck
    threads: int | None = None
    enable_prefix_caching: bool = True
    prefix_checkpoint_bytes: int | None = None  # checkpoint store budget; None: see cache_plan.checkpoint_budget
    batch_invariant: bool | None = None  # None: `resolve_batch_invariant`
    #: prefill tokens per step while any sequence decodes (`Scheduler`, fair steps); None: no cap
    #: (offline throughput); `kvshare serve` defaults to `scheduler.PREFILL_TOKENS_WITH_DECODES`
    prefill_tokens_with_decodes: int | None = None
    #: which implementations the model binds (`kvshare.layers.switches.resolve`): "auto", "native", "torch"
    kernels: str = "auto"
    #: per-field `KernelChoice` overrides (tests; the ``KVSHARE_*`` switches arrive here via `switches.from_env`)
    kernel_overrides: dict[str, bool] | None = None


SMALL_MODEL_PARAMS = 100_000_000
#: batch invariance when EngineArgs.batch_invariant is None (see resolve_batch_invariant)
DEFAULT_BATCH_INVARIANT = True


def resolve_batch_invariant(batch_invariant: bool | None, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether every row is computed alone (ops/invariant.py): the flag if given, else on for bf16
    and fp32 models on the CPU, where the native fixed-order kernels serve the products (decode
    costs the same; prefill is slower, README "Performance"). Other devices keep their batched
    kernels; float64 (the exactness mode, already far below every rounding step) stays batched
    unless asked, since its fixed-order products fall back to one call per row."""
    if batch_invariant is not None:
        return bool(batch_invariant)
    return (DEFAULT_BATCH_INVARIANT and torch.device(device).type == "cpu"
            and dtype in (torch.bfloat16, torch.float32))


def resolve_kernels(args: EngineArgs, batch_invariant: bool, device: torch.device, dtype: torch.dtype
                    ) -> KernelChoice:
    """The `KernelChoice` an engine binds its model to: `args.kernels`, the environment's switches,
    then `args.kernel_overrides` (each later one wins)."""
    overrides = {**switches.from_env(), **(args.kernel_overrides or {})}
    return switches.resolve(batch_invariant, device, dtype, args.kernels, overrides)


def resolve_threads(threads: int | None, model: torch.nn.Module) -> int | None:
    """The torch intra-op thread count the engine sets (None: leave torch's default).

    ``threads`` None means: 1 on the CPU for a model under 100M parameters, else torch's default.
    Measured on the 2-core development VM (notes/bench.md): a small model's step is hundreds of
    tiny ops, and a second thread only adds synchronisation (decode 8x slower under load); big
    GEMMs (released models) do gain from every core, so they keep torch's default.
    """
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        return threads
    params = list(model.parameters())
    if params and all(p.device.type == "cpu" for p in params) and sum(p.numel() for p in params) < SMALL_MODEL_PARAMS:
        return 1
    return None


def apply_threads(threads: int | None, model: torch.nn.Module) -> int:
    """Set torch's intra-op threads as `resolve_threads` says; returns the count now in effect."""
    n = resolve_threads(threads, model)
    if n is not None:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise SetupError(f"--device {device}: not a torch device ({e}); use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise SetupError(f"--device {device}: no CUDA GPU is usable here (torch {torch.__version__} is {build}); "
                         "use --device cpu, or install a CUDA build of torch on a machine with a GPU")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise SetupError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]
