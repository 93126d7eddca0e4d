"""/metrics histograms: the exposition of one histogram written out by hand, and the per-request rules."""

from __future__ import annotations

from types import SimpleNamespace

from kvshare.engine.sequence import RequestMetrics
from kvshare.server.histograms import Histogram, RequestHistograms


def test_histogram_exposition_by_hand() -> None:
    h = Histogram("x_seconds", "help me", (0.1, 1.0, 10.0))
    for v in (0.05, 0.1, 0.5, 3.0, 30.0):
        h.observe(v)
    h.observe(2.0, times=2)
    assert h.render() == [
        "# HELP x_seconds help me", "# TYPE x_seconds histogram",
        'x_seconds_bucket{le="0.1"} 2',  # 0.05 and 0.1 (le: inclusive)
        'x_seconds_bucket{le="1"} 3',
        'x_seconds_bucket{le="10"} 6',
        'x_seconds_bucket{le="+Inf"} 7',
        f"x_seconds_sum {repr(0.05 + 0.1 + 0.5 + 3.0 + 30.0 + 4.0)}",
        "x_seconds_count 7",
    ]


def out(rid: str, new: list[int], tokens: list[int], m: RequestMetrics, reason: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, new_token_ids=new, token_ids=tokens, prompt_token_ids=[1, 2, 3],
                           finished=reason is not None, finish_reason=reason, metrics=m)


def test_request_rules() -> None:
    r = RequestHistograms()
    m = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0)
    r.on_output(out("a", [7], [7], m), now=11.0)  # first token: ttft 1.0
    r.on_output(out("a", [8, 9], [7, 8, 9], m), now=11.4)  # two tokens in 0.4 s: itl 0.2 twice
    m.finished_time = 12.0
    r.on_output(out("a", [5], [7, 8, 9, 5], m, "stop"), now=12.0)  # itl 0.6, then the finish
    assert (r.ttft.count, r.ttft.sum) == (1, 1.0)
    assert r.itl.count == 3 and abs(r.itl.sum - 1.0) < 1e-12
    assert (r.e2e.count, r.e2e.sum, r.queue.sum) == (1, 2.0, 0.5)
    assert (r.prompt.sum, r.generation.sum) == (3, 4)
    aborted = RequestMetrics(arrival_time=0.0, finished_time=1.0)
    r.on_output(out("b", [], [], aborted, "abort"), now=1.0)
    assert r.e2e.count == 1 and not r._last
