"""Project-wide exception types.

Every error a user can cause by a bad config, checkpoint or request is one of these, and its
message names what is wrong, where (field, layer, tensor, request) and what would fix it.
"""

from __future__ import annotations


class KVShareError(Exception):
    """Base class of every error kvshare raises on purpose."""


class ConfigError(KVShareError, ValueError):
    """A model config is invalid.

    Attributes:
        field: the config field at fault (HF name).
        layer: the layer index at fault, or None when the error is not about one layer.
        fix: a short hint on what would make the config valid.
    """

    def __init__(self, message: str, *, field: str, layer: int | None = None, fix: str = "") -> None:
        self.field = field
        self.layer = layer
        self.fix = fix
        where = f"config field `{field}`" + (f", layer {layer}" if layer is not None else "")
        text = f"{where}: {message}"
        if fix:
            text += f" (fix: {fix})"
        super().__init__(text)


class CheckpointError(KVShareError, ValueError):
    """A checkpoint does not match the model: missing, unexpected or mis-shaped tensors."""


class RequestError(KVShareError, ValueError):
    """One request is invalid (too long, empty, bad sampling values); other requests are unaffected."""


class SetupError(KVShareError, ValueError):
    """The engine cannot be set up as asked (device, pool size...); the message names the CLI flags."""
