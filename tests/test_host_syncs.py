"""Host syncs and torch calls of one decode step (issue 23): addresses are built once per step, so
the layers and the cache backend read no device value on the host, and the count of host syncs
does not grow with the number of layers.

Counted with a TorchFunctionMode (tests/torch_calls.py) around ``ModelRunner.forward`` of an
engine decoding 4 sequences whose contexts are past the window and past 2 x index_topk compressed
rows (so every attention path runs: window ring reads, per-row top-k gathers, per-sequence
prefix reads, compressor rings, fp4 / fp8 row packing). In the default (batch-invariant) mode
the MoE groups tokens per expert inside one native call (kernels/moe.py), so a decode step makes
no host sync at all; with batch invariance off its torch dispatch still reads the per-expert token
counts with ``.tolist()`` once per layer (model/moe.py), counted separately (a fixed number per
layer), so a new sync anywhere else fails this test in either mode.
"""

from __future__ import annotations

import json

from torch_calls import CallCounter

from kvshare.config import load_config
from kvshare.engine.engine import LLMEngine
from kvshare.engine.sampling import SamplingParams
from kvshare.model.deepseek import Transformer
from kvshare.shipped import resolve_config_path

MOE = "layers/moe_experts.py"


LAYOUTS = {  # layers -> (compress ratios, kv sources, index sources, candidate source)
    8: ([0, 2, 2, 1, 1, 1, 1, 0], [1, 3], [1, 3, 5], 3),  # kvshare-mini-v41's own
    16: ([0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0], [1, 3, 5], [1, 3, 5, 7, 9], 5),
}


def _config(layers: int) -> dict:
    """kvshare-mini-v41 at small widths, with `layers` layers of every role."""
    d = json.loads(resolve_config_path("kvshare-mini-v41").read_text())
    ratios, kv, index, cand = LAYOUTS[layers]
    d.update(num_hidden_layers=layers, hidden_size=64, moe_intermediate_size=32, head_dim=32, q_lora_rank=32,
             o_lora_rank=32, index_head_dim=32, sliding_window=8, index_topk=4, candidate_topk_blocks=3,
             candidate_block_size=2, quantization_config=None, compress_ratios=ratios, kv_source_layer_ids=kv,
             index_source_layer_ids=index, candidate_source_layer_id=cand)
    return d


def _decode_counts(layers: int, batch_invariant: bool) -> CallCounter:
    cfg = load_config(_config(layers))
    model = Transformer(cfg, quant=True).init_weights(0).eval()
    eng = LLMEngine(model, max_num_seqs=4, num_blocks=64, block_size=16, max_model_len=256,
                    batch_invariant=batch_invariant)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i in range(4):
        eng.add_request(str(i), list(range(3 + i, 43 + 2 * i)), params)  # 40-46 tokens
    for _ in range(3):
        eng.step()  # prefill, then decodes
    forward = eng.runner.forward
    counts: list[CallCounter] = []

    def counted(input_ids, batch):  # noqa: ANN001, ANN202
        with CallCounter() as c:
            out = forward(input_ids, batch)
        counts.append(c)
        return out

    eng.runner.forward = counted
    eng.step()
    assert len(counts) == 1 and counts[0].names["__get__"] > 0
    return counts[0]


def test_host_syncs_per_decode_step_do_not_grow_with_layers() -> None:
    """The default mode (batch-invariant, native MoE): no host sync in a decode step."""
    c8, c16 = _decode_counts(8, True), _decode_counts(16, True)
    # observed: none (before issue 23's addresses the shipped model's decode step made 141, 9 to 16
    # per layer in the cache backend, attention, formats and ops; then one per MoE layer until the
    # native MoE call)
    assert c8.sites == c16.sites == {}, (c8.sites, c16.sites)


def test_batched_mode_syncs_only_in_the_moe_dispatch() -> None:
    c8, c16 = _decode_counts(8, False), _decode_counts(16, False)
    other8 = {k: v for k, v in c8.sites.items() if k != MOE}
    other16 = {k: v for k, v in c16.sites.items() if k != MOE}
    assert other8 == other16 == {}, (c8.sites, c16.sites)
    # the MoE dispatch: one read of the per-expert counts per layer (observed 8 and 16)
    assert c8.sites[MOE] == 8 and c16.sites[MOE] == 16, (c8.sites, c16.sites)
