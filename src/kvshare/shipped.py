"""Configs and models that ship inside the package, addressable by name."""

from __future__ import annotations

from pathlib import Path

from kvshare.errors import ConfigError

CONFIG_DIR = Path(__file__).parent / "configs"
MODEL_DIR = Path(__file__).parent / "models"


def shipped_config_names() -> list[str]:
    """Names accepted wherever a CONFIG argument is (file stem of `kvshare/configs/*.json`)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def resolve_config_path(name_or_path: str) -> Path:
    """A path to a config JSON (or a directory holding config.json), or a shipped config name."""
    p = Path(name_or_path)
    if p.is_dir():
        p = p / "config.json"
    if p.is_file():
        return p
    shipped = CONFIG_DIR / f"{name_or_path}.json"
    if shipped.is_file():
        return shipped
    raise ConfigError(
        f"{name_or_path!r} is neither a config file, a directory with config.json, nor a shipped config",
        field="<path>",
        fix=f"use a path or one of: {', '.join(shipped_config_names())}",
    )


def shipped_model_dir(name: str) -> Path | None:
    """The directory of a model shipped with weights (`kvshare/models/<name>/`), or None.

    Only a plain name qualifies (no path separators), and only when the directory holds a
    ``config.json`` and at least one ``*.safetensors`` file.
    """
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        return None
    d = MODEL_DIR / name
    if (d / "config.json").is_file() and any(d.glob("*.safetensors")):
        return d
    return None
