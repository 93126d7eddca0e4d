"""A memo of values built from a module's parameters, rebuilt after any parameter or submodule
registration anywhere (the native pack sets of attention, the indexer, the compressors and the MoE).

Importing this module installs torch's two global registration hooks (once per process); each bumps
`generation()`. A value kept by `per_generation` at one generation is stale at a later one: a replaced
``weight`` Parameter, `Linear.set_packed`, a replaced expert all register something. In-place edits
of a tensor do not register anything; the native calls check those themselves (the address, dtype and
version stamps of `kernels.moe` / `kernels.attn_proj`).
"""

from __future__ import annotations

from typing import Callable, TypeVar

from torch import nn

T = TypeVar("T")

_GENERATION = [0]  # bumped whenever any module registers a parameter or a submodule


def _bump(*_args: object) -> None:
    _GENERATION[0] += 1


nn.modules.module.register_module_parameter_registration_hook(_bump)
nn.modules.module.register_module_module_registration_hook(_bump)


def generation() -> int:
    """How many parameters and submodules were registered anywhere so far."""
    return _GENERATION[0]


def per_generation(module: nn.Module, key: str, build: Callable[[], T]) -> T:
    """`build()`, kept on `module` under `key` for the current `generation` (the answer None too) and
    built again after any parameter or submodule registration."""
    held = module.__dict__.get(key)
    gen = _GENERATION[0]
    if held is not None and held[0] == gen:
        return held[1]
    value = build()
    module.__dict__[key] = (gen, value)
    return value
