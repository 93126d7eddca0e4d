"""Inference mHC in token chunks: lives in `kvshare.layers.mhc_chunked` (`ChunkedMhc` binds it); the
names stay importable here."""

from __future__ import annotations

from kvshare.layers.mhc_chunked import CHUNK_BYTES, MIN_CHUNKS, HcMix, HcWeights, chunk_rows, hc_boundary, hc_enter, worth_chunking

__all__ = ["CHUNK_BYTES", "MIN_CHUNKS", "HcMix", "HcWeights", "chunk_rows", "hc_boundary", "hc_enter", "worth_chunking"]
