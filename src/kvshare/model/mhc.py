"""Manifold-constrained hyper-connections, mHC (spec/model.md §7.1): the torch reference functions live in
`kvshare.layers.mhc_torch`, the bound layer (enter / boundary / leave / head) in `kvshare.layers.mhc`;
the names stay importable here."""

from __future__ import annotations

from kvshare.layers.mhc_torch import (hc_collapse, hc_expand, hc_head_pre, hc_mix, hc_post_comb, hc_pre_of,
                                      identity_pre)

__all__ = ["hc_collapse", "hc_expand", "hc_head_pre", "hc_mix", "hc_post_comb", "hc_pre_of", "identity_pre"]
