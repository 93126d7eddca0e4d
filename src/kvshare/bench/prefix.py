"""Prefix caching on vs off: a shared prefix with several different suffixes (V4.1-shaped model).

Both engines serve the same model with the same chunking. Each first runs the shared prefix alone
(one token), which the caching engine keeps (blocks + the boundary checkpoint at the prefix end), as
a system prompt or a previous turn would be. Then the suffix requests (prefix + a different suffix
each) run one at a time, alternating between the engines. Per engine: prompt tokens the model
computed for the suffix requests, their median time to first token, the cached tokens the engine
reported, and whether the greedy tokens equal the other engine's.

Targets (issue 14): prefill tokens computed drop by >= 90% and TTFT by >= 5x with caching on.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from kvshare.bench.gen import equal_length_prompts
from kvshare.bench.kv_runner import greedy, make_engine
from kvshare.bench.report import Section, Target
from kvshare.bench.sizes import BenchSizes

FULL_SHAPE = (2048, 64, 8)  # prefix tokens, suffix tokens, suffix requests
QUICK_SHAPE = (256, 16, 3)
NEW_TOKENS = 4


def _first_token(engine: Any, rid: str, prompt: list[int]) -> tuple[float, int, list[int]]:
    """(seconds to the first token, cached tokens, greedy tokens) of one request run alone."""
    engine.add_request(rid, prompt, greedy(NEW_TOKENS))
    t0 = time.perf_counter()
    ttft, out = float("nan"), None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.token_ids and ttft != ttft:
                ttft = time.perf_counter() - t0
            out = o
    assert out is not None
    return ttft, out.num_cached_tokens, list(out.token_ids)


def prefix_section(s: BenchSizes, model: Any, *, quick: bool, dtype: str, device: str) -> Section:
    n_prefix, n_suffix, n_req = QUICK_SHAPE if quick else FULL_SHAPE
    total = n_prefix + n_suffix
    sec = Section("prefix", f"Prefix caching on vs off: a {n_prefix}-token shared prefix, {n_req} different "
                  f"{n_suffix}-token suffixes, V4.1-shaped {s.v41_layers} layers",
                  ["caching", "prompt tokens computed", "cached tokens reported", "median TTFT ms",
                   "tokens equal"])
    ids = equal_length_prompts(1 + n_req, total, s.vocab, s.seed + 23)
    prefix = ids[0, :n_prefix].tolist()
    prompts = [prefix + ids[1 + i, :n_suffix].tolist() for i in range(n_req)]
    engines = {on: make_engine(model, batch=2, max_len=total + NEW_TOKENS + 1, block_size=s.block_size,
                               dtype=dtype, device=device, max_batched_tokens=total + 1, enable_prefix_caching=on)
               for on in (True, False)}
    res: dict[bool, dict[str, Any]] = {on: {"ttft": [], "cached": [], "tokens": []} for on in engines}
    for on, eng in engines.items():
        _first_token(eng, "prefix", prefix)
        res[on]["base"] = eng.stats().prompt_tokens
    for i, p in enumerate(prompts):
        for on, eng in engines.items():
            t, c, toks = _first_token(eng, f"s{i}", p)
            r = res[on]
            r["ttft"].append(t)
            r["cached"].append(c)
            r["tokens"].append(toks)
    for on, eng in engines.items():
        r = res[on]
        r["computed"] = eng.stats().prompt_tokens - r["base"]
        r["median_ttft_s"] = statistics.median(r["ttft"])
    same = res[True]["tokens"] == res[False]["tokens"]
    for on in (True, False):
        r = res[on]
        sec.rows.append(["on" if on else "off", r["computed"], sum(r["cached"]), r["median_ttft_s"] * 1e3, same])
    drop = 1 - res[True]["computed"] / res[False]["computed"]
    speedup = res[False]["median_ttft_s"] / res[True]["median_ttft_s"]
    sec.rows.append(["drop / speedup", drop, "", speedup, ""])
    sec.data = {"prefix_tokens": n_prefix, "suffix_tokens": n_suffix, "requests": n_req, "block_size": s.block_size,
                "computed_on": res[True]["computed"], "computed_off": res[False]["computed"],
                "cached_reported": res[True]["cached"], "ttft_on_s": res[True]["ttft"],
                "ttft_off_s": res[False]["ttft"], "tokens_equal": same, "prefill_drop": drop, "ttft_speedup": speedup,
                "checkpoint_bytes": engines[True].stats().prefix_cache_checkpoint_bytes}
    sec.targets.append(Target("prefill tokens computed, drop with caching", drop, 0.90, ">="))
    sec.targets.append(Target("median time to first token, off / on", speedup, 5.0, ">="))
    sec.targets.append(Target("greedy tokens equal with caching on and off", float(same), 1.0, "=="))
    sec.notes.append(f"Both engines first ran the shared prefix alone ({n_prefix} tokens, not counted above), "
                     "as a system prompt or an earlier turn would have been; the suffix requests then ran one at a "
                     "time, alternating between the engines. Counting that warm-up, caching on computed "
                     f"{res[True]['computed'] + n_prefix:,} prompt tokens against {res[False]['computed'] + n_prefix:,}.")
    sec.plot = _plot
    return sec


def _plot(ax: Any, s: Section) -> None:
    d = s.data
    names = ["prompt tokens computed", "median TTFT"]
    on = [d["computed_on"] / d["computed_off"], statistics.median(d["ttft_on_s"]) / statistics.median(d["ttft_off_s"])]
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [1.0, 1.0], width=0.4, label="caching off (=1)")
    ax.bar([x + 0.2 for x in xs], on, width=0.4, label="caching on")
    for x, r in zip(xs, on):
        ax.annotate(f"{r:.3f}x", (x + 0.2, r), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("relative to caching off")
    ax.legend(fontsize=8)
