"""Engine flags shared by `kvshare generate`, `chat`, `serve` and `bench`.

`add_engine_args(parser)` adds them; `engine_args_from(args)` turns the parsed values into the
keyword arguments of `LLM(model, **kw)` / `LLMEngine`, leaving out flags the user did not set so
the engine's own defaults (`EngineArgs`) apply.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from kvshare.cli.arg_types import parse_bytes, positive_float, positive_int

DEFAULT_MODEL = "kvshare-mini-v41"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add the model and engine flags to `parser` (in their own help group)."""
    g = parser.add_argument_group("model and engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="model directory (config.json, weights, tokenizer.json) or shipped config name; "
                        f"default {DEFAULT_MODEL} (byte-level vocabulary)")
    g.add_argument("--random-weights", action="store_true",
                   help="run a config that has no weights (a shipped config name such as tiny-v41, or a "
                        "directory with only config.json) with random weights from a fixed seed; for testing")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "float64"],
                   help="dtype of weights and activations (default: the engine's choice for the device; "
                        "float64 is the exactness mode, README 'Reproducibility')")
    g.add_argument("--device", default=None,
                   help="torch device, e.g. cpu, cuda, cuda:1 (default: cuda when available, else cpu)")
    g.add_argument("--block-size", type=positive_int, default=None,
                   help="tokens per KV-cache block; a multiple of every compress ratio (default: engine's)")
    g.add_argument("--kv-format", default=None,
                   help="row format of the compressed KV cache: auto (packed fp4/fp8 when quantising, else "
                        "plain rows in the model dtype), fp4, fp8, fp8_v4, bf16 or fp32 (default auto)")
    mem = g.add_mutually_exclusive_group()
    mem.add_argument("--memory", type=parse_bytes, default=None, metavar="SIZE",
                     help="bytes to give the KV-cache pool, e.g. 2GiB; the pool sizes itself from the "
                          "cache owners only, so sharing turns into more blocks")
    mem.add_argument("--num-blocks", type=positive_int, default=None,
                     help="exact number of KV-cache blocks to allocate (instead of --memory)")
    g.add_argument("--max-num-seqs", type=positive_int, default=None,
                   help="most sequences batched in one step (continuous batching width)")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                   help="most tokens processed in one step; longer prompts are prefilled in chunks")
    g.add_argument("--prefill-tokens-with-decodes", type=positive_int, default=None, metavar="N",
                   help="prefill tokens per step while other requests decode, so their streams keep "
                        "their pace (default: no cap; `serve`: 12)")
    g.add_argument("--max-model-len", type=positive_int, default=None,
                   help="longest prompt + completion accepted (default: the model's max positions)")
    g.add_argument("--no-share-kv-cache", dest="share_kv_cache", action="store_false", default=True,
                   help="give every compressed layer its own cache copy (to measure what sharing saves)")
    g.add_argument("--no-quantize", dest="quantize", action="store_false", default=True,
                   help="turn off the FP8/FP4 cache and activation fake-quantisation the checkpoint was "
                        "trained with")
    g.add_argument("--engram-table", default=None, choices=["mmap", "memory"],
                   help="where Engram (V4.1) tables live on the host: mmap = memory-mapped from the checkpoint "
                        "(default; little resident memory), memory = read into RAM at load (fastest lookups)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "dspark", "num_speculative_tokens": 5}\' '
                        "(the model's mtp.* DSpark stages draft, the model verifies; output unchanged)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="exact prefix caching: reuse the cached blocks and boundary checkpoint of a prompt's "
                        "longest cached prefix (default on; --no-enable-prefix-caching turns it off)")
    g.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="compute every token row alone, so a prompt's tokens do not depend on what runs beside "
                        "it, on chunking or on speculation (fixed-order products; README 'Reproducibility')")
    g.add_argument("--seed", type=int, default=None,
                   help="seed of the sampler's random stream (generate and chat also seed their request "
                        "with it, so a run is reproducible); random weights always use the model's fixed seed")
    g.add_argument("--tensor-parallel-size", "--tp", dest="tensor_parallel_size", type=positive_int, default=None,
                   help="shard the model over N processes on this machine (gloo on CPU, NCCL on CUDA); under "
                        "torchrun, N must equal its process count (default 1)")
    g.add_argument("--tp-step-timeout", type=positive_float, default=None, metavar="S",
                   help="with --tensor-parallel-size > 1: a worker that makes no progress for S seconds within "
                        "a step (stopped, hung) stops the engine like a dead worker (default 60)")
    g.add_argument("--threads", type=positive_int, default=None,
                   help="torch intra-op CPU threads (default: 1 for models under 100M parameters, whose ops "
                        "are too small to gain from threads, else torch's default)")


# flag dest -> engine keyword
_ENGINE_KEYS = {
    "dtype": "dtype",
    "device": "device",
    "block_size": "block_size",
    "kv_format": "kv_format",
    "memory": "gpu_memory_bytes",
    "num_blocks": "num_blocks",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "prefill_tokens_with_decodes": "prefill_tokens_with_decodes",
    "max_model_len": "max_model_len",
    "share_kv_cache": "share_kv_cache",
    "quantize": "quantize",
    "seed": "seed",
    "engram_table": "engram_table",
    "speculative_config": "speculative_config",
    "tensor_parallel_size": "tensor_parallel_size",
    "tp_step_timeout": "tp_step_timeout",
    "threads": "threads",
    "enable_prefix_caching": "enable_prefix_caching",
    "batch_invariant": "batch_invariant",
}

_THREE_STATE = {"batch_invariant"}  # None = the engine's default, so True is passed too


def _engine_fields() -> set[str] | None:
    """Field names of the engine's `EngineArgs`, or None when it cannot be imported."""
    try:
        from kvshare.engine.args import EngineArgs
    except ImportError:
        return None
    if dataclasses.is_dataclass(EngineArgs):
        return {f.name for f in dataclasses.fields(EngineArgs)}
    return None


def engine_args_from(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for `LLM` / `LLMEngine`: `model` plus every engine flag the user set.

    Boolean switches that default on are passed only when turned off, three-state ones (default
    None) whenever given; keys the engine's `EngineArgs` does not know are dropped (with `model`
    always kept).
    """
    kw: dict[str, Any] = {"model": getattr(args, "model", DEFAULT_MODEL)}
    for dest, key in _ENGINE_KEYS.items():
        value = getattr(args, dest, None)
        if value is None or (value is True and dest not in _THREE_STATE):
            continue
        kw[key] = value
    known = _engine_fields()
    if known is not None:
        kw = {k: v for k, v in kw.items() if k == "model" or k in known}
    return kw


def build_engine(args: argparse.Namespace) -> Any:
    """An `LLMEngine` for the parsed engine flags, with the model's tokenizer."""
    from kvshare.llm import build_engine as build
    from kvshare.tokenizer import load_tokenizer

    kw = engine_args_from(args)
    model = kw.pop("model")
    require_weights(model, getattr(args, "random_weights", False))
    require_memory(model, kw.get("dtype"))
    return build(model, load_tokenizer(model), **kw)


def require_weights(model: str, random_weights: bool) -> None:
    """KVShareError unless `model` has weights to load (or random ones were asked for).

    Shipped config names (deepseek-v4-flash, tiny-v41...) describe models for `kvshare plan`;
    running one without weights would generate noise, and the large ones need many GB first."""
    from pathlib import Path

    from kvshare.errors import KVShareError
    from kvshare.weights.checkpoint_files import refuse_pickle_only
    from kvshare.weights.loader import has_weights
    from kvshare.shipped import shipped_model_dir

    p = Path(model)
    if random_weights or (not p.exists() and shipped_model_dir(model) is not None):
        return
    weights_dir = p if p.is_dir() else p.parent if p.is_file() else None
    if weights_dir is not None:
        refuse_pickle_only(weights_dir)
        if has_weights(weights_dir):
            return
    what = f"{model!r} is a config without weights" if weights_dir is None else f"{weights_dir} has no weights"
    raise KVShareError(f"{what}: its outputs would be noise. Give a directory with safetensors weights, "
                       f"use `kvshare plan {model}` for its memory arithmetic, or add --random-weights to run "
                       "it with random weights anyway")


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def require_memory(model: str, dtype: str | None) -> None:
    """KVShareError when the model's weights alone cannot fit in this machine's available memory.

    Counted from the config's tensor shapes (nothing is allocated), at 4 bytes per parameter
    for --dtype float32 and 2 otherwise (bf16 is the engine's default); the check only applies to
    CPU memory."""
    from kvshare.config import load_config
    from kvshare.errors import KVShareError
    from kvshare.weights.hf_naming import released_shapes
    from kvshare.shipped import shipped_model_dir

    free = available_memory()
    if free is None:
        return
    cfg = load_config(str(shipped_model_dir(model) or model))
    params = 0
    for shape in released_shapes(cfg).values():
        n = 1
        for s in shape:
            n *= s
        params += n
    need = params * (4 if dtype == "float32" else 2)
    if need > free:
        raise KVShareError(f"{model} has {params / 1e9:,.1f}B parameters: {need / 2**30:,.1f} GiB of weights, more "
                           f"than the {free / 2**30:,.1f} GiB of memory available here; use a smaller model "
                           "(e.g. kvshare-mini-v41) or `kvshare plan` for its arithmetic")


def tokenizer_of(engine: Any, model: str) -> Any:
    """The engine's tokenizer, or the one `load_tokenizer` finds for `model`."""
    tok = getattr(engine, "tokenizer", None)
    if tok is not None:
        return tok
    from kvshare.tokenizer import load_tokenizer

    return load_tokenizer(model)


def max_model_len_of(engine: Any) -> int | None:
    """The longest prompt + completion the engine accepts, when it says."""
    for owner in (engine, getattr(engine, "args", None), getattr(engine, "engine_args", None),
                  getattr(engine, "config", None)):
        v = getattr(owner, "max_model_len", None) if owner is not None else None
        if isinstance(v, int):
            return v
    return None
