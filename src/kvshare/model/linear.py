"""Linear layers whose input is FP8-rounded when the checkpoint weight is FP8/FP4 (spec/model.md §6):
the layers live in `kvshare.layers.linear` (bound once); their names stay importable here."""

from __future__ import annotations

from kvshare.layers.linear import Linear, QLinear, pack_linears, packing_available, plain_linear

__all__ = ["Linear", "QLinear", "pack_linears", "packing_available", "plain_linear"]
