"""Quantised peer comparison: the peer V4 bench model stored as the release stores it (FP8 e4m3
linears with 128 x 128 ue8m0 block scales, FP4 e2m1 routed experts with ue8m0 scales per 32
inputs), run by kvshare with the weights kept packed (kvshare.kernels) and by transformers on the
same checkpoint dequantised to bf16 (how it runs FP8 / FP4 on a CPU).

The checkpoint is written with `save_checkpoint` and read back with `load_model` (bf16, fake
quantisation off on both sides, so both compute the same math on the same weights). One thread
(set here, restored after). Reported: decode / prefill tok/s at each batch with the ratios,
weight bytes in memory against the checkpoint's, and the bytes a batch-1 decode step reads per
second against the copy bandwidth measured in the same section.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from kvshare.bench.gen import GenResult, compare_tokens, equal_length_prompts
from kvshare.bench.kv_runner import build_model, kv_run
from kvshare.bench.measure import copy_bandwidth
from kvshare.bench.report import Section, Target
from kvshare.bench.sizes import BenchSizes, peer_v4_config
from kvshare.config import ModelConfig

TARGET_DECODE_B1 = 3.0
TARGET_DECODE_B8 = 2.5
TARGET_BANDWIDTH_FRACTION = 0.6


def quantised_checkpoint(cfg: ModelConfig, seed: int, out_dir: str) -> int:
    """Write the bench model (seeded random weights) in the release's formats; returns its bytes."""
    from kvshare.layers.linear import QLinear
    from kvshare.weights.checkpoint_write import save_checkpoint
    from kvshare.weights.weights_quant import release_quantize

    model = build_model(cfg, seed, torch.bfloat16)
    names = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, QLinear)}
    state = release_quantize(model.state_dict(), names)
    save_checkpoint(state, cfg, out_dir)
    buffers = {n for n, _ in model.named_buffers()}
    return sum(t.numel() * t.element_size() for n, t in state.items() if n not in buffers)


def decode_read_bytes(model: torch.nn.Module, n_experts: int, k: int, batch: int) -> int:
    """Weight bytes one decode step of `batch` tokens reads (packed bytes for packed weights):
    `bandwidth.weight_bytes_per_step`."""
    from kvshare.bench.bandwidth import weight_bytes_per_step

    return weight_bytes_per_step(model, n_experts, k, batch)


def quantised_section(s: BenchSizes, *, device: str = "cpu", with_peer: bool = True) -> Section:
    """Run the comparison (see module doc)."""
    from kvshare import kernels
    from kvshare.model.dtypes import weight_bytes
    from kvshare.weights.loader import load_checkpoint, load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = ModelConfig.from_dict(peer_v4_config(s))
        with tempfile.TemporaryDirectory() as tmp:
            ck_bytes = quantised_checkpoint(cfg, s.seed, tmp)
            model = load_model(tmp, dtype=torch.bfloat16, quant=False)
            hf = None
            if with_peer:
                from kvshare.bench.hf_peer import build_hf_model

                hf = build_hf_model(cfg, load_checkpoint(tmp, cfg), torch.bfloat16, device)
        return _measure(s, cfg, model, hf, ck_bytes, weight_bytes(model), kernels.isa(), device)
    finally:
        torch.set_num_threads(threads)


def _measure(s: BenchSizes, cfg: ModelConfig, model: torch.nn.Module, hf: Any, ck_bytes: int, mem_bytes: int,
             isa: str, device: str) -> Section:
    from kvshare.bench.hf_peer import hf_generate, hf_warmup

    copy = copy_bandwidth(s.copy_mib * 2**20, device=device)
    sec = Section("quant", f"quantised V4 bench model (FP8 linears, FP4 experts as released), kvshare kernels "
                  f"({isa}) vs transformers on the dequantised checkpoint, 1 thread, hidden {s.hidden}, "
                  f"prompt {s.prompt_len}, {s.new_tokens} new tokens",
                  ["batch", "engine", "prefill tok/s", "decode tok/s", "TPOT ms", "weights MiB", "tokens identical"])
    hf_bytes = sum(p.numel() * p.element_size() for p in hf.parameters()) if hf is not None else 0
    runs: list[dict[str, Any]] = []
    for b in s.batches:
        prompts = equal_length_prompts(b, s.prompt_len, s.vocab, s.seed + b)
        kv_runs: list[GenResult] = []
        hf_runs: list[GenResult] = []
        for rep in range(max(1, s.repeats)):
            res, _ = kv_run(model, prompts, s.new_tokens, block_size=s.block_size, dtype="bfloat16",
                            device=device, warmup=rep == 0)
            kv_runs.append(res)
            if hf is not None:
                if rep == 0:
                    hf_warmup(hf, prompts, device)
                hf_runs.append(hf_generate(hf, prompts, s.new_tokens, device))
        kv = max(kv_runs, key=lambda r: r.decode_tps)
        kv_prefill = max(r.prefill_tps for r in kv_runs)
        step_s = 1.0 / kv.decode_tps * b if kv.decode_tps > 0 else float("nan")
        read = decode_read_bytes(model, cfg.n_routed_experts, cfg.num_experts_per_tok, b)
        entry: dict[str, Any] = {"batch": b, "kvshare_decode_tok_s": kv.decode_tps, "kvshare_prefill_tok_s": kv_prefill,
                                 "decode_step_s": step_s, "weight_read_bytes": read,
                                 "weight_read_gbps": read / step_s / 1e9}
        same = "n/a"
        if hf_runs:
            ref = max(hf_runs, key=lambda r: r.decode_tps)
            ref_prefill = max(r.prefill_tps for r in hf_runs)
            cmp = compare_tokens(kv.tokens, ref.tokens)
            same = f"{cmp['sequences_identical']}/{cmp['sequences']}"
            entry.update(transformers_decode_tok_s=ref.decode_tps, transformers_prefill_tok_s=ref_prefill,
                         ratio_decode=kv.decode_tps / ref.decode_tps, ratio_prefill=kv_prefill / ref_prefill)
            sec.rows.append([b, "kvshare", kv_prefill, kv.decode_tps, kv.tpot_ms, mem_bytes / 2**20, same])
            sec.rows.append([b, "transformers", ref_prefill, ref.decode_tps, ref.tpot_ms, hf_bytes / 2**20, same])
            sec.rows.append([b, "kvshare/tf", entry["ratio_prefill"], entry["ratio_decode"], kv.tpot_ms / ref.tpot_ms,
                             mem_bytes / max(1, hf_bytes), ""])
        else:
            sec.rows.append([b, "kvshare", kv_prefill, kv.decode_tps, kv.tpot_ms, mem_bytes / 2**20, same])
        runs.append(entry)
    sec.data = {"config": cfg.to_dict(), "checkpoint_bytes": ck_bytes, "weight_bytes_in_memory": mem_bytes,
                "transformers_weight_bytes": hf_bytes, "copy": copy, "isa": isa, "runs": runs}
    sec.targets.append(Target("weight bytes in memory / checkpoint bytes", mem_bytes / ck_bytes, 1.02, "<="))
    for b, target in ((1, TARGET_DECODE_B1), (8, TARGET_DECODE_B8)):
        r = next((r for r in runs if r["batch"] == b and "ratio_decode" in r), None)
        if r is not None:
            sec.targets.append(Target(f"decode tok/s at batch {b}, kvshare / transformers", r["ratio_decode"],
                                      target, ">="))
    r1 = next((r for r in runs if r["batch"] == 1), None)
    if r1 is not None:
        sec.targets.append(Target("batch-1 decode weight reads / copy read bandwidth",
                                  r1["weight_read_gbps"] / copy["read_gbps"], TARGET_BANDWIDTH_FRACTION, ">="))
    sec.notes.append(f"checkpoint {ck_bytes / 2**20:.1f} MiB, kvshare holds {mem_bytes / 2**20:.1f} MiB, "
                     f"transformers {hf_bytes / 2**20:.1f} MiB (dequantised bf16); copy read bandwidth "
                     f"{copy['read_gbps']:.1f} GB/s; best decode and best prefill of {max(1, s.repeats)} "
                     "alternating runs per engine")
    return sec
