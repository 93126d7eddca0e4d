"""Test-session settings shared by every test module."""

import torch

# The suite runs tiny models whose ops are far too small to gain from intra-op threads; on a
# 2-core machine one thread is several times faster and keeps results independent of the load.
torch.set_num_threads(1)


import pytest  # noqa: E402


@pytest.fixture
def small_mhc_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunked inference mHC in 5-row chunks for the tiny test models (hidden 32, 4 streams), so
    model and engine tests run prefills and wide decode batches through several chunks (steps of
    <= 5 rows take the unchunked path)."""
    from kvshare.model import mhc_chunked

    monkeypatch.setattr(mhc_chunked, "CHUNK_BYTES", 5 * 4 * 4 * 32)
    monkeypatch.setattr(mhc_chunked, "MIN_CHUNKS", 1)
