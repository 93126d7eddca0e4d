"""Server counters and their Prometheus text exposition (GET /metrics).

The engine thread updates the counters and keeps the latest `engine.stats()` snapshot; the event
loop renders them. A lock guards the recent-token window that tokens/s is computed from.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from typing import Any

from kvshare.server.memory import rss_bytes
from kvshare.server.histograms import RequestHistograms

_RATE_WINDOW_S = 10.0

# cumulative EngineStats fields: exposed as counters named kvshare_engine_<field>_total
_ENGINE_COUNTERS = ("num_steps", "num_preemptions", "prompt_tokens", "generation_tokens", "spec_num_verifies",
                    "spec_draft_tokens", "spec_accepted_tokens", "prefix_cache_queried_tokens",
                    "prefix_cache_hit_tokens")

# metric name -> (EngineStats attribute names to try, help text)
_ENGINE_GAUGES: dict[str, tuple[tuple[str, ...], str]] = {
    "kvshare_requests_running": (("running", "num_running"), "Requests scheduled in the running batch."),
    "kvshare_requests_waiting": (("waiting", "num_waiting"), "Requests queued for admission."),
    "kvshare_cache_blocks_used": (("blocks_used", "num_blocks_used", "used_blocks"), "KV-cache blocks in use."),
    "kvshare_cache_blocks_total": (("blocks_total", "num_blocks", "total_blocks", "num_blocks_total"),
                                   "KV-cache blocks in the pool (null block excluded where the engine says so)."),
    "kvshare_cache_bytes_per_block": (("bytes_per_block", "block_bytes"), "Bytes of one KV-cache block."),
    "kvshare_cache_bytes_total": (("cache_bytes", "pool_bytes", "bytes_total", "total_bytes"),
                                  "Bytes allocated for the KV-cache pool."),
}


def stat(stats: Any, *names: str) -> float | None:
    """The first of `names` that `stats` (an object or a dict) has as a number, else None."""
    if stats is None:
        return None
    for n in names:
        v = stats.get(n) if isinstance(stats, dict) else getattr(stats, n, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return v
    return None


def blocks_used_total(stats: Any) -> tuple[int | None, int | None]:
    """(blocks used, blocks total) from an engine stats snapshot."""
    used = stat(stats, *_ENGINE_GAUGES["kvshare_cache_blocks_used"][0])
    total = stat(stats, *_ENGINE_GAUGES["kvshare_cache_blocks_total"][0])
    return (None if used is None else int(used)), (None if total is None else int(total))


class ServerMetrics:
    """Counters of one server process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._recent: deque[tuple[float, int]] = deque()
        self._recent_prompt: deque[tuple[float, int]] = deque()
        self._last_prompt_tokens: float | None = None
        self._started = time.monotonic()
        self.engine_stats: Any = None
        self.requests_total = 0
        self.requests_finished = 0
        self.requests_aborted = 0
        self.requests_rejected = 0
        self.requests_failed = 0
        self.http_active = 0
        self.client_disconnects = 0  # clients gone before their request body arrived (not failures)
        self.generated_tokens_total = 0
        self.steps_total = 0
        self.step_seconds_total = 0.0
        self.heap_trims = 0  # times the idle engine loop returned free heap pages to the OS
        self.requests = RequestHistograms()  # latency and size histograms (histograms.py)

    # ---- engine thread -----------------------------------------------------------------------

    def on_request_added(self) -> None:
        """A request entered the engine."""
        self.requests_total += 1

    def on_request_done(self, aborted: bool) -> None:
        """A request left the engine, finished or aborted."""
        if aborted:
            self.requests_aborted += 1
        else:
            self.requests_finished += 1

    def on_output(self, out: Any) -> None:
        """A request's output was routed (feeds the per-request histograms)."""
        self.requests.on_output(out)

    def on_step(self, new_tokens: int, seconds: float) -> None:
        """One engine step produced `new_tokens` tokens in `seconds`."""
        now = time.monotonic()
        with self._lock:
            self.generated_tokens_total += new_tokens
            self.steps_total += 1
            self.step_seconds_total += seconds
            if new_tokens:
                self._recent.append((now, new_tokens))
            self._trim(now)

    def on_stats(self, stats: Any) -> None:
        """A fresh `engine.stats()` snapshot; prompt tokens processed since the last one feed the rate."""
        self.engine_stats = stats
        prompt = stat(stats, "prompt_tokens")
        if prompt is None:
            return
        with self._lock:
            if self._last_prompt_tokens is not None and prompt > self._last_prompt_tokens:
                self._recent_prompt.append((time.monotonic(), int(prompt - self._last_prompt_tokens)))
            self._last_prompt_tokens = prompt

    def _trim(self, now: float) -> None:
        for window in (self._recent, self._recent_prompt):
            while window and window[0][0] < now - _RATE_WINDOW_S:
                window.popleft()

    # ---- event loop --------------------------------------------------------------------------

    def tokens_per_second(self, prompt: bool = False) -> float:
        """Generated (or, with `prompt`, prefilled) tokens per second over the last few seconds."""
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            tokens = sum(n for _, n in (self._recent_prompt if prompt else self._recent))
        span = min(_RATE_WINDOW_S, max(now - self._started, 1e-3))
        return tokens / span

    def render(self) -> str:
        """Prometheus text exposition format (version 0.0.4)."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, value: float | None) -> None:
            if value is None:
                return
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            lines.append(f"{name} {_fmt(value)}")

        stats = self.engine_stats
        for name, (keys, help_text) in _ENGINE_GAUGES.items():
            metric(name, "gauge", help_text, stat(stats, *keys))
        used, total = blocks_used_total(stats)
        bpb = stat(stats, *_ENGINE_GAUGES["kvshare_cache_bytes_per_block"][0])
        if used is not None and bpb is not None:
            metric("kvshare_cache_bytes_used", "gauge", "Bytes of the KV-cache blocks in use.", used * bpb)
        reported_total = stat(stats, *_ENGINE_GAUGES["kvshare_cache_bytes_total"][0])
        if total is not None and bpb is not None and reported_total is None:
            metric("kvshare_cache_bytes_total", "gauge", "Bytes of all KV-cache blocks in the pool.", total * bpb)
        if used is not None and total:
            metric("kvshare_cache_usage_ratio", "gauge", "Fraction of KV-cache blocks in use.", used / total)
        metric("kvshare_http_requests_active", "gauge", "Generation requests being served over HTTP.",
               self.http_active)
        metric("kvshare_requests_total", "counter", "Requests added to the engine.", self.requests_total)
        metric("kvshare_requests_finished_total", "counter", "Requests that finished normally.",
               self.requests_finished)
        metric("kvshare_requests_aborted_total", "counter", "Requests aborted (client gone or error).",
               self.requests_aborted)
        metric("kvshare_requests_rejected_total", "counter", "Requests refused with a 4xx.",
               self.requests_rejected)
        metric("kvshare_requests_failed_total", "counter", "Requests that failed with a 5xx.",
               self.requests_failed)
        metric("kvshare_http_client_disconnects_total", "counter",
               "Clients that disconnected before their request body arrived.", self.client_disconnects)
        metric("kvshare_generated_tokens_total", "counter", "Tokens generated by the engine.",
               self.generated_tokens_total)
        metric("kvshare_generation_tokens_per_second", "gauge",
               f"Generated tokens per second over the last {_RATE_WINDOW_S:g} s.", self.tokens_per_second())
        metric("kvshare_prompt_tokens_per_second", "gauge",
               f"Prompt tokens prefilled per second over the last {_RATE_WINDOW_S:g} s.",
               self.tokens_per_second(prompt=True))
        metric("kvshare_engine_steps_total", "counter", "Engine steps run.", self.steps_total)
        metric("kvshare_engine_step_seconds_total", "counter", "Seconds spent in engine steps.",
               self.step_seconds_total)
        metric("process_resident_memory_bytes", "gauge", "Resident memory of the server process in bytes.",
               rss_bytes())
        metric("kvshare_heap_trims_total", "counter",
               "Times the idle engine loop returned the C heap's free pages to the OS (malloc_trim).", self.heap_trims)
        for key, value in _other_stats(stats):
            if key in _ENGINE_COUNTERS:
                metric(f"kvshare_engine_{key}_total", "counter", f"EngineStats.{key} since the engine started.",
                       value)
            else:
                metric(f"kvshare_engine_{key}", "gauge", f"EngineStats.{key}.", value)
        lines.extend(self.requests.render())
        return "\n".join(lines) + "\n"


def _other_stats(stats: Any) -> list[tuple[str, float]]:
    """Numeric engine stats not already exposed under a named metric."""
    if stats is None:
        return []
    if dataclasses.is_dataclass(stats):
        items = dataclasses.asdict(stats)
    elif isinstance(stats, dict):
        items = stats
    else:
        items = {k: v for k, v in vars(stats).items() if not k.startswith("_")}
    if isinstance(items.get("extra"), dict):  # EngineStats.extra: e.g. speculative decoding figures
        items = {**items, **items["extra"]}
    named = {k for keys, _ in _ENGINE_GAUGES.values() for k in keys}
    return [(k, v) for k, v in items.items()
            if k not in named and isinstance(v, (int, float)) and not isinstance(v, bool)]


def _fmt(v: float) -> str:
    return str(int(v)) if isinstance(v, int) or float(v).is_integer() else f"{v:.6g}"
