"""RMSNorm (spec/model.md §4.1): the layer and its functions live in `kvshare.layers.norm`.

The names stay importable here for the model files. `rms_normalize_as` is the transitional
per-call version (`kvshare.layers.transitional`) that `model/attention.py` uses until it passes
its bound choice to `layers.norm.rms_normalize_as(x, eps, native=...)`.
"""

from __future__ import annotations

from kvshare.layers.norm import RMSNorm, rms_normalize
from kvshare.layers.transitional import rms_normalize_as

__all__ = ["RMSNorm", "rms_normalize", "rms_normalize_as"]
