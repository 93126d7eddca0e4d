"""Prefill at the released attention sizes (issue 19): kvshare vs transformers on the same weights.

The model is the peer V4 model with head_dim 512, 128-dim index keys and top-512 selection
(`released_attention_config`). `prefill_batch` prompts of `prompt_len` tokens are prefilled in one
engine step (kvshare) and one `generate` forward (transformers). Reported per engine: time to
first token (every prompt's first token out), time per prompt token, and kvshare's batched decode
time per token (median decode step / batch) from the same generation, which the prefill time per
token is compared with.
"""

from __future__ import annotations

from typing import Any

from kvshare.bench.gen import compare_tokens, equal_length_prompts
from kvshare.bench.kv_runner import DTYPES, build_model, kv_run
from kvshare.bench.report import Section, Target
from kvshare.bench.sizes import BenchSizes, released_attention_config
from kvshare.config import ModelConfig

TARGET_PER_TOKEN_VS_DECODE = 1 / 3
TARGET_TTFT_S = 6.0
TARGET_TTFT_TOKENS = 2048


def prefill_section(s: BenchSizes, *, dtype: str, device: str, with_peer: bool = True) -> Section:
    cfg = ModelConfig.from_dict(released_attention_config(s))
    model = build_model(cfg, s.seed, DTYPES[dtype], device)
    n_params = sum(p.numel() for p in model.parameters())
    b, n_new = s.prefill_batch, max(4, min(s.new_tokens, 8))
    prompts = equal_length_prompts(b, s.prompt_len, s.vocab, s.seed + 100)
    kv, _ = kv_run(model, prompts, n_new, block_size=s.block_size, dtype=dtype, device=device)
    n_tok = b * s.prompt_len
    sec = Section("prefill", f"prefill at released attention sizes: V4 {s.peer_layers} layers, head_dim "
                  f"{cfg.head_dim}, index {cfg.index_head_dim}-dim top-{cfg.index_topk}, {n_params / 1e6:.1f}M "
                  f"params, {dtype}, {b} prompts x {s.prompt_len} tokens",
                  ["engine", "TTFT s", "ms / prompt token", "prefill tok/s", "decode ms / token (batched)",
                   "tokens identical"])
    kv_decode_tok = kv.decode.median / b
    data: dict[str, Any] = {"config": cfg.to_dict(), "params": n_params, "prompt_tokens": n_tok,
                            "kvshare": kv.as_dict(), "kvshare_decode_s_per_token": kv_decode_tok}
    same = "n/a"
    ref = None
    if with_peer:
        from kvshare.bench.hf_peer import build_hf_model, hf_generate, hf_warmup

        hf = build_hf_model(cfg, model.state_dict(), DTYPES[dtype], device)
        hf_warmup(hf, prompts, device)
        ref = hf_generate(hf, prompts, n_new, device)
        del hf
        cmp = compare_tokens(kv.tokens, ref.tokens)
        same = f"{cmp['sequences_identical']}/{cmp['sequences']}"
        data.update(transformers=ref.as_dict(), tokens=cmp)
    sec.rows.append(["kvshare", kv.prefill_s, kv.prefill_s / n_tok * 1e3, kv.prefill_tps, kv_decode_tok * 1e3, same])
    if ref is not None:
        sec.rows.append(["transformers", ref.prefill_s, ref.prefill_s / n_tok * 1e3, ref.prefill_tps,
                         ref.decode.median / b * 1e3, same])
        sec.rows.append(["kvshare / transformers", kv.prefill_s / ref.prefill_s, "", kv.prefill_tps / ref.prefill_tps,
                         "", ""])
    per_tok = kv.prefill_s / n_tok
    sec.targets.append(Target("prefill time per token / batched decode time per token",
                              per_tok / kv_decode_tok, TARGET_PER_TOKEN_VS_DECODE, "<="))
    sec.targets.append(Target(f"seconds for {TARGET_TTFT_TOKENS} prompt tokens (scaled from {n_tok})",
                              per_tok * TARGET_TTFT_TOKENS, TARGET_TTFT_S, "<="))
    sec.notes.append(f"decode: median of {n_new - 1} batched steps after the prefill; TTFT includes scheduling")
    sec.data = data
    return sec
