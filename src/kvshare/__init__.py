"""kvshare: an inference engine for DeepSeek-V4 / V4.1 models that share their KV cache across layers."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# Imported lazily so `import kvshare` (CLI start-up, config tools) does not pull in torch.
_LAZY = {
    "LLM": "kvshare.llm",
    "SamplingParams": "kvshare.engine.sampling",
    "RequestOutput": "kvshare.engine.outputs",
    "EngineArgs": "kvshare.engine.args",
    "LLMEngine": "kvshare.engine.engine",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvshare' has no attribute {name!r}")
