"""Memory comes back (issue 28, item 6): `release_free_memory` (glibc malloc_trim) returns the free
pages of a fragmented heap, the idle engine loop calls it after requests end, and /metrics
reports the process's RSS."""

from __future__ import annotations

import json
import time
from typing import Iterator

import httpx
import pytest

from kvshare.server.app import create_app
from kvshare.server.background import BackgroundServer
from kvshare.server.memory import release_free_memory, rss_bytes
from kvshare.tokenizer import load_tokenizer

MODEL = "tiny-v41"


def _vm_rss() -> int:
    """VmRSS from /proc/self/status (a different file than `rss_bytes` reads), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_trim_returns_the_free_pages_of_a_fragmented_heap() -> None:
    """200 MB of 4 KiB buffers, one in 64 kept: without a trim glibc keeps the holes (the RSS stays
    up); malloc_trim(0) hands back their pages. Observed: -190 MB on trim. Mutation: the trim a
    no-op -> the drop is ~0 and the test fails."""
    if not release_free_memory():
        pytest.skip("not glibc: no malloc_trim")
    blocks = [bytearray(4096) for _ in range(50_000)]  # 4 KiB: malloc'd, below the mmap threshold
    for b in blocks:
        b[::512] = b"x" * 8  # touch every page
    kept = blocks[::64]
    del blocks
    before = _vm_rss()
    release_free_memory()
    after = _vm_rss()
    assert before - after > 120 * 2**20, (before, after)
    assert len(kept) == 782


def test_rss_bytes_matches_proc_status() -> None:
    assert abs(rss_bytes() - _vm_rss()) < 8 * 2**20  # type: ignore[operator]


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    from kvshare.engine.engine import LLMEngine

    engine = LLMEngine(MODEL, tokenizer=load_tokenizer(MODEL), seed=0, max_num_seqs=4, max_model_len=64)
    app = create_app(engine, engine.tokenizer, MODEL, max_model_len=64)
    with BackgroundServer(app) as srv:
        yield srv


def _metric(server: BackgroundServer, name: str) -> float:
    text = httpx.get(server.base_url + "/metrics").text
    return float(next(l for l in text.splitlines() if l.startswith(name + " ")).split()[1])


def test_idle_loop_trims_after_requests_and_metrics_report_rss(server: BackgroundServer) -> None:
    """Mutation: `_freed` never set -> no trim after the requests, heap_trims stays put."""
    trims = _metric(server, "kvshare_heap_trims_total")
    for i in range(3):
        r = httpx.post(server.base_url + "/v1/completions", json={"prompt": [5 + i, 6], "max_tokens": 3}, timeout=60)
        assert r.status_code == 200
    deadline = time.monotonic() + 5
    while _metric(server, "kvshare_heap_trims_total") == trims and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _metric(server, "kvshare_heap_trims_total") > trims
    reported = _metric(server, "process_resident_memory_bytes")
    assert abs(reported - _vm_rss()) < 32 * 2**20, (reported, _vm_rss())  # the same process, moments apart


def _container_sizes(root: object, name: str) -> dict[str, int]:
    """len() of every dict, list, set and deque reachable from `root` through the attributes of
    kvshare objects and torch modules (tensors not entered; containers of up to 64 items entered),
    keyed by the path that reaches it first."""
    import collections

    import torch

    out: dict[str, int] = {}
    seen: set[int] = set()
    stack: list[tuple[object, str]] = [(root, name)]
    while stack:
        obj, path = stack.pop()
        if id(obj) in seen or isinstance(obj, torch.Tensor):
            continue
        seen.add(id(obj))
        if isinstance(obj, (dict, list, set, collections.deque)):
            out[path] = len(obj)
            if len(obj) <= 64 and not isinstance(obj, set):
                items = obj.items() if isinstance(obj, dict) else enumerate(obj)
                stack.extend((v, f"{path}[{k!r}]") for k, v in items)
        elif type(obj).__module__.startswith("kvshare") or isinstance(obj, torch.nn.Module):
            stack.extend((v, f"{path}.{k}") for k, v in vars(obj).items())
    return out


def _mixed_requests(server: BackgroundServer, start: int, n: int) -> None:
    """`n` requests of every kind the server keeps state for, one after another."""
    url = server.base_url
    for i in range(start, start + n):
        kind = i % 6
        prompt = [5 + i % 50, 6, 7 + i % 3][: 1 + i % 3]
        if kind == 0:  # seeded sampling, n > 1, logprobs, a stop string
            body = {"prompt": prompt, "max_tokens": 4, "temperature": 0.9, "seed": i, "n": 2, "logprobs": 2,
                    "stop": ["zz"]}
            assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        elif kind == 1:  # a stream read to its end
            with httpx.stream("POST", url + "/v1/completions", timeout=60,
                              json={"prompt": prompt, "max_tokens": 5, "stream": True}) as r:
                assert r.status_code == 200 and sum(1 for _ in r.iter_lines()) > 0
        elif kind == 2:  # a client gone mid-stream
            with httpx.stream("POST", url + "/v1/completions", timeout=60,
                              json={"prompt": prompt, "max_tokens": 40, "stream": True, "ignore_eos": True}) as r:
                next(r.iter_lines())
        elif kind == 3:  # chat
            body = {"messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 3}
            assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
        elif kind == 4:  # a bad body over OFF_LOOP_BYTES (the child refuses it)
            raw = json.dumps({"prompt": [7] * 40_000}).encode()
            assert httpx.post(url + "/v1/completions", content=raw, timeout=60,
                              headers={"Content-Type": "application/json"}).status_code == 400
        else:  # an invalid value, refused on admission
            assert httpx.post(url + "/v1/completions", json={"prompt": prompt, "temperature": -1},
                              timeout=60).status_code == 400


def test_nothing_grows_per_request_in_the_servers_state(server: BackgroundServer) -> None:
    """After 12 requests of every kind, 24 more leave every dict / list / set / deque reachable from
    the server's state (engine loop, engine, scheduler, sampler, prefix cache, model modules,
    metrics: ~3,500 containers) no longer than before (but the rate windows, which hold the last
    few seconds, and the executor's plan of the last step); what a request leaves behind would
    grow them by 24. Mutations caught: the sampler keeping each seeded request's generator
    (`forget` not popping `_seq_generators`), the engine loop keeping finished streams."""
    state = server.app.state.kvshare
    _mixed_requests(server, 0, 12)
    deadline = time.monotonic() + 10
    while (state.active or state.loop._streams) and time.monotonic() < deadline:  # the gone client's abort
        time.sleep(0.05)
    before = _container_sizes(state, "state")
    _mixed_requests(server, 12, 24)
    while (state.active or state.loop._streams) and time.monotonic() < deadline + 10:
        time.sleep(0.05)
    after = _container_sizes(state, "state")
    assert len(before) > 1000 and any(k.endswith("sampler._seq_generators") for k in before), len(before)
    grown = {k: (before.get(k, 0), v) for k, v in after.items()
             if v > before.get(k, 0) and k not in _TIMED and _LAST_STEP not in k}
    assert not grown, grown


# Bounded by time, not by requests: the steps of the last `metrics._RATE_WINDOW_S` seconds (the rates).
_TIMED = {"state.metrics._recent", "state.metrics._recent_prompt", "state.loop._recent"}  # bounded windows
# The executor's plan of the step before (one step, replaced by the next): its sizes are those of
# whichever request came last.
_LAST_STEP = ".executor._last."
