"""Quantised cache rows for the in-place attention: decoded once per step where that pays
(`PagedAttention.decode_pays`, `PagedBackend.window_keys` / ``pool_keys`` with ``decode=True``), else
read where they are stored and decoded by the kernel (``reader_decodes=True``).

With the FP8 / FP4 cache formats (``quantize=True``) a gather of every query row's keys costs
T x (window + top-k) decoded rows: a 1,024-token prefill chunk of V4.1-Flash-sized layers copied
~0.8 GB per layer. A step that reads more rows than its sequences hold decodes each slot's window
ring and the blocks of each sequence's compressed prefix once and hands the copies to the in-place
kernel; a decode step (one token per sequence) hands the kernel the stored rows with their codec
(`RowFormat.codec`): it decodes each key it reads (window + picks: a cost that does not grow with
the context), with no gathered copy and no torch ops per layer.

References: the gather path of the same engine (`PagedAttention.in_place` returning None): every
sampled logits row bitwise equal (the same keys in the same order through the same arithmetic,
tests/test_native_attention.py), and the path counts per step kind.
"""

from __future__ import annotations

import pytest
import torch
from test_engine_exact import greedy_random_run, spy_logits

from kvshare.config import load_config
from kvshare.engine.engine import LLMEngine
from kvshare.kernels import decode as native
from kvshare.layers.attention import PagedAttention
from kvshare.model import Transformer

_IN_PLACE = PagedAttention.in_place

pytestmark = pytest.mark.skipif(not native.enabled(), reason="native kernels unavailable on this machine")


def _serve(name: str, dtype: torch.dtype, in_place: bool, monkeypatch: pytest.MonkeyPatch):
    """Greedy tokens, every sampled logits row, and the in-place calls of prefill-chunk / decode
    forwards (tokens per sequence > 1 or not) of a quantised paged engine: chunked prefill beside
    decodes, slots reused (a request of the second wave takes a finished one's slot), decode past
    the window ring's wrap."""
    model = Transformer(load_config(name), quant=False).init_weights(3).eval().to(dtype)
    calls = {"chunk": 0, "decode": 0, "decode forwards": 0}

    def counted(self, q, kv, picks, ctx, sink):
        o = _IN_PLACE(self, q, kv, picks, ctx, sink) if in_place else None
        kind = "chunk" if ctx.addr.num_tokens > ctx.addr.num_seqs else "decode"
        calls["decode forwards"] += kind == "decode"
        if o is not None:
            calls[kind] += 1
        return o

    monkeypatch.setattr(PagedAttention, "in_place", counted)
    eng = LLMEngine(model, batch_invariant=True, quantize=True, dtype=str(dtype).split(".")[1],
                    block_size=128 if name == "tiny-v4" else 16, num_blocks=16 if name == "tiny-v4" else 48,
                    max_num_seqs=3, max_num_batched_tokens=19, enable_prefix_caching=False)
    rows = spy_logits(eng)
    # 5 requests on 3 slots: the last two take recycled slots (slot order != sequence order);
    # 140: the HCA layer of tiny-v4 gets an entry
    done = greedy_random_run(eng, model.cfg.vocab_size, (37, 5, 23, 140, 30), seed=4, max_tokens=12)
    return done, rows, calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41"])
def test_decoded_rows_give_the_bits_of_the_gather_path(name: str, dtype: torch.dtype,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens and every logits row bitwise those of the gather path; prefill chunks took the decoded
    in-place path on every layer, decode steps the stored rows read in place (every layer of every
    decode step). Mutations caught: the ring copy read by slot (``window_meta()``
    in `window_keys`' decoded branch: all four), the decoded blocks' tables one block off
    (``arange(n * c) + 1`` clamped: all four), the pool read with the window ring's codec (tiny-v41:
    fp4 kv rows, fp8_v41 window rows)."""
    ref_tokens, ref_rows, ref_calls = _serve(name, dtype, False, monkeypatch)
    tokens, rows, calls = _serve(name, dtype, True, monkeypatch)
    assert ref_calls["chunk"] == ref_calls["decode"] == 0
    layers = load_config(name).num_hidden_layers
    assert calls["chunk"] >= layers * 5 and calls["decode"] == calls["decode forwards"] >= layers * 11, calls
    assert tokens == ref_tokens
    assert rows.keys() == ref_rows.keys()
    for k in rows:
        assert torch.equal(rows[k], ref_rows[k]), k


def test_decode_steps_gather_and_chunks_decode() -> None:
    """`decode_pays` from host ints: one token per sequence reads the stored rows (window + picks <=
    window + the prefix), a chunk of many tokens decodes a copy; a ratio-0 layer decodes a copy once a
    sequence has two rows."""
    from types import SimpleNamespace

    def ctx(tokens: int, seqs: int, width: int):
        pre = SimpleNamespace(width=width)
        return SimpleNamespace(addr=SimpleNamespace(num_tokens=tokens, num_seqs=seqs, prefix=lambda r: pre))

    topk = PagedAttention(2, 1, 128, 512)
    picks = torch.zeros(1, 512, dtype=torch.int64)
    assert not topk.decode_pays(ctx(1, 1, 32768), picks)
    assert not topk.decode_pays(ctx(4, 4, 100), picks)
    assert topk.decode_pays(ctx(1024, 1, 32768), picks)
    window = PagedAttention(0, 0, 128, 512)
    assert not window.decode_pays(ctx(3, 3, 0), None)
    assert window.decode_pays(ctx(4, 3, 0), None)
