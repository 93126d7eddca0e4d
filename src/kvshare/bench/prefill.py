"""Prefill at the released attention sizes (issue 19): kvshare vs transformers on the same weights.

The model is the peer V4 model with head_dim 512, 128-dim index keys and top-512 selection
(`released_attention_config`). `prefill_batch` prompts of `prompt_len` tokens are prefilled in one
engine step (kvshare) and one `generate` forward (transformers). Reported per engine: time to
first token (every prompt's first token out), time per prompt token, and kvshare's batched decode
time per token (median decode step / batch) from the same generation, which the prefill time per
token is compared with. With repeats the engines' runs alternate and each reports its fastest
prefill and fastest decode; with ``llama-cpp-python`` installed, llama.cpp runs the same prompts on
GGUFs of the same weights (checkpoint dtype and q8_0) in the same alternation.
"""

from __future__ import annotations

from typing import Any

import torch

from kvshare.bench.gen import GenResult, best_of, compare_tokens, equal_length_prompts
from kvshare.bench.kv_runner import DTYPES, build_model, kv_run
from kvshare.bench.llamacpp_peer import lc_generate, lc_warmup, llamacpp_peers
from kvshare.bench.report import Section, Target
from kvshare.bench.sizes import BenchSizes, released_attention_config
from kvshare.config import ModelConfig

TARGET_PER_TOKEN_VS_DECODE = 1 / 3
TARGET_TTFT_S = 6.0
TARGET_TTFT_TOKENS = 2048


def prefill_section(s: BenchSizes, *, dtype: str, device: str, with_peer: bool = True,
                    with_llamacpp: bool = True, fetch: bool = True) -> Section:
    cfg = ModelConfig.from_dict(released_attention_config(s))
    model = build_model(cfg, s.seed, DTYPES[dtype], device)
    with llamacpp_peers(model, cfg, dtype, device, with_llamacpp, fetch) as (lc_models, lc_note):
        sec = _prefill_section(s, cfg, model, lc_models, dtype=dtype, device=device, with_peer=with_peer)
    sec.notes.append(lc_note)
    return sec


def _prefill_section(s: BenchSizes, cfg: ModelConfig, model: Any, lc_models: list[Any], *, dtype: str,
                     device: str, with_peer: bool) -> Section:
    n_params = sum(p.numel() for p in model.parameters())
    b, n_new = s.prefill_batch, max(4, min(s.new_tokens, 8))
    prompts = equal_length_prompts(b, s.prompt_len, s.vocab, s.seed + 100)
    hf = None
    if with_peer:
        from kvshare.bench.hf_peer import build_hf_model, hf_generate, hf_warmup

        hf = build_hf_model(cfg, model.state_dict(), DTYPES[dtype], device)
    kv_runs: list[GenResult] = []
    hf_runs: list[GenResult] = []
    lc_runs: dict[str, list[GenResult]] = {m.label: [] for m in lc_models}
    threads = torch.get_num_threads()
    for rep in range(max(1, s.repeats)):  # alternate the engines; keep each one's fastest run
        kv_runs.append(kv_run(model, prompts, n_new, block_size=s.block_size, dtype=dtype, device=device,
                              warmup=rep == 0)[0])
        if hf is not None:
            if rep == 0:
                hf_warmup(hf, prompts, device)
            hf_runs.append(hf_generate(hf, prompts, n_new, device))
        for m in lc_models:
            if rep == 0:
                lc_warmup(m, prompts, threads)
            lc_runs[m.label].append(lc_generate(m, prompts, n_new, threads))
    del hf
    kv = best_of(kv_runs)
    n_tok = b * s.prompt_len
    sec = Section("prefill", f"prefill at released attention sizes: V4 {s.peer_layers} layers, head_dim "
                  f"{cfg.head_dim}, index {cfg.index_head_dim}-dim top-{cfg.index_topk}, {n_params / 1e6:.1f}M "
                  f"params, {dtype}, {b} prompts x {s.prompt_len} tokens",
                  ["engine", "TTFT s", "ms / prompt token", "prefill tok/s", "decode ms / token (batched)",
                   "tokens identical"])
    kv_decode_tok = kv.decode.median / b
    data: dict[str, Any] = {"config": cfg.to_dict(), "params": n_params, "prompt_tokens": n_tok,
                            "kvshare": kv.as_dict(), "kvshare_decode_s_per_token": kv_decode_tok,
                            "kvshare_all_prefill_s": [r.prefill_s for r in kv_runs]}
    same = "n/a"
    ref = None
    if hf_runs:
        ref = best_of(hf_runs)
        cmp = compare_tokens(kv.tokens, ref.tokens)
        same = f"{cmp['sequences_identical']}/{cmp['sequences']}"
        data.update(transformers=ref.as_dict(), tokens=cmp, transformers_all_prefill_s=[r.prefill_s for r in hf_runs])
    sec.rows.append(["kvshare", kv.prefill_s, kv.prefill_s / n_tok * 1e3, kv.prefill_tps, kv_decode_tok * 1e3, same])
    if ref is not None:
        sec.rows.append(["transformers", ref.prefill_s, ref.prefill_s / n_tok * 1e3, ref.prefill_tps,
                         ref.decode.median / b * 1e3, same])
        sec.rows.append(["kvshare / transformers", kv.prefill_s / ref.prefill_s, "", kv.prefill_tps / ref.prefill_tps,
                         "", ""])
    data["llamacpp"] = {}
    for label, runs in lc_runs.items():
        lc = best_of(runs)
        cmp = compare_tokens(kv.tokens, lc.tokens)
        data["llamacpp"][label] = {"result": lc.as_dict(), "tokens_vs_kvshare": cmp,
                                   "all_prefill_s": [r.prefill_s for r in runs]}
        sec.rows.append([lc.engine, lc.prefill_s, lc.prefill_s / n_tok * 1e3, lc.prefill_tps,
                         lc.decode.median / b * 1e3, f"{cmp['sequences_identical']}/{cmp['sequences']} vs kvshare"])
        sec.notes.append(f"{lc.engine} vs kvshare: first differing token per sequence {cmp['first_divergence']} "
                         "(None: identical)")
    per_tok = kv.prefill_s / n_tok
    sec.targets.append(Target("prefill time per token / batched decode time per token",
                              per_tok / kv_decode_tok, TARGET_PER_TOKEN_VS_DECODE, "<="))
    sec.targets.append(Target(f"seconds for {TARGET_TTFT_TOKENS} prompt tokens (scaled from {n_tok})",
                              per_tok * TARGET_TTFT_TOKENS, TARGET_TTFT_S, "<="))
    sec.notes.append(f"decode: median of {n_new - 1} batched steps after the prefill; TTFT includes scheduling; "
                     f"best of {max(1, s.repeats)} alternating runs per engine")
    sec.data = data
    return sec
