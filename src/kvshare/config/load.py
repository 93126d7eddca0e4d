"""load_config: a ModelConfig from whatever names one (config, dict, path, directory, shipped name)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvshare.config.model import ModelConfig
from kvshare.shipped import resolve_config_path


def load_config(source: str | Path | dict[str, Any] | ModelConfig) -> ModelConfig:
    """Accept a ModelConfig, a dict, a path, a directory, or a shipped config name."""
    if isinstance(source, ModelConfig):
        return source
    if isinstance(source, dict):
        return ModelConfig.from_dict(source)
    return ModelConfig.from_path(resolve_config_path(str(source)))
