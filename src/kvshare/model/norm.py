"""RMSNorm (spec/model.md §4.1): the layer and its functions live in `kvshare.layers.norm`; the
names stay importable here for the model files."""

from __future__ import annotations

from kvshare.layers.norm import RMSNorm, rms_normalize, rms_normalize_as

__all__ = ["RMSNorm", "rms_normalize", "rms_normalize_as"]
