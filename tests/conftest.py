"""Test-session settings shared by every test module."""

import torch

# The suite runs tiny models whose ops are far too small to gain from intra-op threads; on a
# 2-core machine one thread is several times faster and keeps results independent of the load.
torch.set_num_threads(1)


import pytest  # noqa: E402


@pytest.fixture
def small_prefill_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill-only fast paths at the tiny test models' sizes, so model and engine tests (chunked
    prefill, preemption, batching, the transformers oracle) run them: chunked inference mHC in
    5-row chunks (hidden 32, 4 streams; steps of <= 5 rows take the unchunked path), and the
    per-sequence window attention for every sequence with >= 4 rows in the step."""
    from kvshare.layers import mhc_chunked
    from kvshare.ops import prefix_attention

    monkeypatch.setattr(mhc_chunked, "CHUNK_BYTES", 5 * 4 * 4 * 32)
    monkeypatch.setattr(mhc_chunked, "MIN_CHUNKS", 1)
    monkeypatch.setattr(prefix_attention, "BY_SEQUENCE_MIN_ROWS", 4)
