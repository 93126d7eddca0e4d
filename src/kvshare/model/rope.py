"""Interleaved partial RoPE with optional YaRN (spec/model.md §4.2): the layer lives in
`kvshare.layers.rope` (bound once: torch reference or the native kernel); its names stay importable here."""

from __future__ import annotations

from kvshare.layers.rope import TABLES_KEPT, RotaryEmbedding, rope_frequencies

__all__ = ["TABLES_KEPT", "RotaryEmbedding", "rope_frequencies"]
