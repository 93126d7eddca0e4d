"""The one module that reads kvshare's switches from the environment.

Every ``KVSHARE_*`` switch that changes which implementation a model runs is read here, once per
call of `from_env`, and turned into the arguments `resolve` takes; nothing else in kvshare reads
them. Tests and programs pass the same arguments directly (`EngineArgs.kernels`,
`EngineArgs.kernel_overrides`) instead of setting the environment.

| variable | effect |
|---|---|
| ``KVSHARE_KERNELS=off`` | no native kernels at all (the pure-torch path) |
| ``KVSHARE_NATIVE_DECODE=off`` | no native decode kernels (packed GEMMs of FP8 / FP4 weights stay) |
| ``KVSHARE_NATIVE_ATTENTION=off`` | the torch attention and index scores |
| ``KVSHARE_NATIVE_MHC=off`` | the mHC pieces as separate native calls (the same bits) |
| ``KVSHARE_NATIVE_ATTN_PROJ=off`` | attention's projections as the torch composition (the same bits) |
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from kvshare.layers.choice import KernelChoice

_OFF = ("off", "0", "torch", "false", "no")
#: environment variable -> the `KernelChoice` field it turns off
ENV_SWITCHES = {
    "KVSHARE_KERNELS": "gemm",
    "KVSHARE_NATIVE_DECODE": "native",
    "KVSHARE_NATIVE_ATTENTION": "attention",
    "KVSHARE_NATIVE_MHC": "fused_mhc",
    "KVSHARE_NATIVE_ATTN_PROJ": "fused_attn_proj",
}


_VAR_OF = {field: var for var, field in ENV_SWITCHES.items()}


def from_env(environ: Mapping[str, str] | None = None) -> dict[str, bool]:
    """The per-op overrides the environment asks for (field -> False), e.g. {"fused_mhc": False}."""
    env = os.environ if environ is None else environ
    return {field: False for var, field in ENV_SWITCHES.items() if env.get(var, "").strip().lower() in _OFF}


def switched_off(field: str) -> bool:
    """Whether the environment turns `field` off now (one variable read; `kernels.decode.enabled`,
    which the cache-row codecs ask per call, reads ``native`` through it)."""
    return os.environ.get(_VAR_OF[field], "").strip().lower() in _OFF


def resolve(batch_invariant: bool, device: torch.device, dtype: torch.dtype, kernels: str = "auto",
            overrides: Mapping[str, bool] | None = None) -> KernelChoice:
    """The `KernelChoice` for a model of `dtype` on `device`.

    ``kernels``: "auto" (native where the library serves this machine), "native" (the same, but an
    error where it cannot), or "torch" (the reference implementations). ``overrides``: per-field
    values (from `from_env` or a test) applied last; a True override cannot turn on what the machine
    cannot run.
    """
    from kvshare.kernels.build import best_isa  # (builds or loads the native library on first use)

    if kernels not in ("auto", "native", "torch"):
        raise ValueError(f"kernels must be 'auto', 'native' or 'torch', got {kernels!r}")
    servable = torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float32)
    native = kernels != "torch" and servable and best_isa() != "torch"
    if kernels == "native" and not native:
        why = "a bf16 / fp32 model on the CPU" if not servable else "kvshare's native library (a C++ compiler)"
        raise ValueError(f"kernels='native' needs {why}")
    choice = KernelChoice(batch_invariant=batch_invariant, gemm=native, native=native, attention=native, fused_mhc=native,
                          fused_attn_proj=native)
    for field, value in (overrides or {}).items():
        if field not in KernelChoice.__dataclass_fields__:
            raise ValueError(f"unknown kernel override {field!r}; use one of {sorted(KernelChoice.__dataclass_fields__)}")
        choice = choice.with_(**{field: bool(value) and (field == "batch_invariant" or native)})
    return choice.normalised()


def default_choice(batch_invariant: bool = False) -> KernelChoice:
    """The choice of a model built outside an engine: the native kernels where this machine has them
    (and the environment allows), batched products unless `batch_invariant`."""
    return resolve(batch_invariant, torch.device("cpu"), torch.float32, "auto", from_env())
