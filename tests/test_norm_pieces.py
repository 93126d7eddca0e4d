"""layers.norm.rms_normalize_as: x / sqrt(mean(x^2) + eps) per row (eps 0.5, so eps shows),
rounded once into x's dtype; the same bits whole or in pieces of rows (pieces of 3 rows here,
with a remainder piece)."""

from __future__ import annotations

import pytest
import torch

import kvshare.layers.norm as norm


def _reference(x: torch.Tensor, eps: float) -> torch.Tensor:
    """float64, row by row."""
    rows = x.double().reshape(-1, x.shape[-1])
    out = torch.stack([r / torch.sqrt((r * r).sum() / r.numel() + eps) for r in rows])
    return out.view(x.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_pieces_match_the_formula_and_the_whole_tensor_bits(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 2, 16, generator=g) * torch.rand(5, 2, 1, generator=g) * 4).to(dtype)  # 10 rows
    whole = norm.rms_normalize(x, 0.5).to(dtype)
    monkeypatch.setattr(norm, "PIECED_FROM", 1)
    monkeypatch.setattr(norm, "PIECE_ELEMENTS", 3 * 16)
    with torch.inference_mode():
        pieces = norm.rms_normalize_as(x, 0.5)
    assert pieces.dtype == dtype and pieces.shape == x.shape
    assert torch.equal(pieces, whole)
    ulp = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float64: 1e-15}[dtype]
    # observed max |diff| vs float64: fp32 1.5e-7, bf16 6.6e-3 (the final rounding), float64 4.4e-16
    assert torch.allclose(pieces.double(), _reference(x, 0.5), atol=ulp, rtol=0)
