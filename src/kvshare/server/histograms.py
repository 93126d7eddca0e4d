"""Prometheus histograms of per-request latencies and sizes (GET /metrics).

A `Histogram` keeps cumulative-ready bucket counts, a sum and a count; `render` writes the
exposition lines ``<name>_bucket{le="..."}`` (cumulative, ending with ``+Inf``), ``<name>_sum`` and
``<name>_count``. `RequestHistograms.on_output` is fed every `RequestOutput` the engine loop routes:

* time to first token: engine ``first_token_time - arrival_time`` (observed once, at the first token);
* inter-token latency: the wall time between two outputs of a request divided over the tokens
  the later one brought (a speculative step brings several), observed once per token;
* end-to-end latency ``finished_time - arrival_time``, queue time ``first_scheduled_time -
  arrival_time``, prompt tokens and generation tokens: observed when a request finishes with
  "stop" or "length" (aborted and failed requests are not counted).
"""

from __future__ import annotations

import bisect
import threading
import time
from typing import Any

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class Histogram:
    """Observations of one quantity in fixed buckets (upper bounds, inclusive, as Prometheus' `le`)."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help_text, tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # the last: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, c in zip(self.buckets, self.counts):
            total += c
            lines.append(f'{self.name}_bucket{{le="{_num(bound)}"}} {total}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {_num(self.sum)}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


class RequestHistograms:
    """The per-request histograms; `on_output` runs on the engine thread, `render` on the event loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}  # request id -> wall time of its latest output with tokens
        self.ttft = Histogram("kvshare_time_to_first_token_seconds", "Time from arrival to the first token.",
                              LATENCY_BUCKETS)
        self.itl = Histogram("kvshare_inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                             LATENCY_BUCKETS)
        self.e2e = Histogram("kvshare_e2e_request_latency_seconds", "Time from arrival to the end of a request.",
                             LATENCY_BUCKETS)
        self.queue = Histogram("kvshare_request_queue_time_seconds", "Time from arrival to first scheduling.",
                               LATENCY_BUCKETS)
        self.prompt = Histogram("kvshare_request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_BUCKETS)
        self.generation = Histogram("kvshare_request_generation_tokens", "Generated tokens per finished request.",
                                    TOKEN_BUCKETS)

    def on_output(self, out: Any, now: float | None = None) -> None:
        """Account one `RequestOutput` (now: time.perf_counter() when it was routed)."""
        now = time.perf_counter() if now is None else now
        m = out.metrics
        new = len(out.new_token_ids or ())
        with self._lock:
            last = self._last.get(out.request_id)
            if new:
                if last is None:
                    if m.first_token_time is not None:
                        self.ttft.observe(m.first_token_time - m.arrival_time)
                else:
                    self.itl.observe((now - last) / new, times=new)
                self._last[out.request_id] = now
            if out.finished:
                self._last.pop(out.request_id, None)
                if out.finish_reason in ("stop", "length"):
                    if m.finished_time is not None:
                        self.e2e.observe(m.finished_time - m.arrival_time)
                    if m.first_scheduled_time is not None:
                        self.queue.observe(m.first_scheduled_time - m.arrival_time)
                    self.prompt.observe(len(out.prompt_token_ids))
                    self.generation.observe(len(out.token_ids))

    def render(self) -> list[str]:
        with self._lock:
            return [line for h in (self.ttft, self.itl, self.e2e, self.queue, self.prompt, self.generation)
                    for line in h.render()]
