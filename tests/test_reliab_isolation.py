"""No request harms another (issue 36): one test per item, each failing on the code before it.

1. a grammar that overflows llguidance's stack is a 400 from a `kvshare serve` subprocess that
   goes on serving; a compile child that dies costs only its grammar;
2. grammars compile off the engine thread, once for a request's n choices;
3. stop strings are held back incrementally (bounded work per update, equal to brute force), and a
   disconnect aborts every choice of a request;
4. fair steps (a long prefill beside decodes is chunked) and fair admission (one request cannot
   hold every slot);
6. bounded replies (413 naming the limit) and /tokenize off the event loop;
7. bad inputs are one-line 400s that never echo the input;
8. /health turns 503 within seconds of a stuck step.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import threading
import time
from typing import Any, Iterator

import httpx
import pytest
from serve_proc import start_serve

from kvshare.cache.blocks import BlockManager
from kvshare.engine.sampling import SamplingParams
from kvshare.engine.scheduler import Scheduler
from kvshare.engine.sequence import Sequence
from kvshare.server.app import create_app
from kvshare.server.background import BackgroundServer
from kvshare.server.responses import TextDeltas
from kvshare.tokenizer import load_tokenizer

pytest.importorskip("llguidance")

MODEL = "tiny-v41"


def chain_grammar(rules: int) -> str:
    """The issue's crash: `rules` chained Lark rules (3,000 overflow an 8 MiB stack in llguidance)."""
    return "start: r0\n" + "".join(f'r{i}: r{i + 1} "a" | "b"\n' for i in range(rules)) + f'r{rules}: "c"\n'


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- 1. no crash -------------------------------------------------------------------------------------

def test_a_grammar_that_crashed_the_server_is_a_400_and_the_server_goes_on() -> None:
    """Before: the 3,000-rule grammar compiled on the engine thread and the server died with SIGSEGV
    (the request got no reply). Now it is a one-line 400 and the next request is served."""
    port = _free_port()
    srv = start_serve(port, "--model", MODEL, "--random-weights", "--log-level", "warning", "--max-model-len", "256")
    url = f"http://127.0.0.1:{port}"
    try:
        body = {"prompt": "x", "max_tokens": 4, "structured_outputs": {"grammar": chain_grammar(3000)}}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 400, r.text
        msg = r.json()["error"]["message"]
        assert "\n" not in msg and len(msg) <= 200, msg
        assert srv.poll() is None
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        srv.terminate()
        srv.wait(30)


def test_a_compile_child_that_dies_costs_only_its_grammar() -> None:
    """The child compiling a slow regex is killed: that grammar gets a RequestError, the next one
    compiles in a new child. Mutation caught: no respawn (`_running` returning the dead process)."""
    from kvshare.engine.structured import StructuredOutputs
    from kvshare.engine.structured_spec import StructuredSpec
    from kvshare.errors import RequestError
    from kvshare.tokenizer import ByteTokenizer

    so = StructuredOutputs(ByteTokenizer(259), 259, frozenset([257]))
    try:
        so.compile(StructuredSpec("regex", "[ab]+"))  # starts the child
        pid = so._child._proc.pid  # type: ignore[union-attr]
        threading.Timer(0.3, os.kill, (pid, signal.SIGKILL)).start()
        with pytest.raises(RequestError, match="crashed"):
            so.compile(StructuredSpec("regex", "(a{1000}){1000}", "structured_outputs.regex"))
        assert so.compile(StructuredSpec("regex", "x[0-9]")).mask[ord("x")]
    finally:
        so.close()


# ---- a server in this process ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    from kvshare.engine.engine import LLMEngine

    engine = LLMEngine(MODEL, tokenizer=load_tokenizer(MODEL), seed=0, max_num_seqs=16, max_model_len=256)
    app = create_app(engine, engine.tokenizer, MODEL, max_concurrent_requests=32, max_model_len=256)
    with BackgroundServer(app) as srv:
        yield srv


# ---- 2. compile off the engine thread, once per request ----------------------------------------------------

def test_grammars_compile_off_the_engine_thread_once_per_request(server: BackgroundServer,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: each of the n choices built its matcher (a compile) on the engine thread. Now one
    compile, on the compile thread; the choices copy it."""
    import llguidance

    real = llguidance.LLMatcher
    threads: list[str] = []

    def spy(*a: Any, **k: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*a, **k)

    for name in dir(real):
        if not name.startswith("_"):
            setattr(spy, name, getattr(real, name))
    monkeypatch.setattr(llguidance, "LLMatcher", spy)
    from kvshare.engine.structured import StructuredOutputs

    real_compile = StructuredOutputs._compile
    callers: list[str] = []  # the thread that waits for each compile

    def compile_spy(self: Any, spec: Any) -> Any:
        callers.append(threading.current_thread().name)
        return real_compile(self, spec)

    monkeypatch.setattr(StructuredOutputs, "_compile", compile_spy)
    body = {"prompt": "x", "n": 4, "max_tokens": 6, "temperature": 1.0, "seed": 3,
            "structured_outputs": {"regex": "q[0-9]{3}z"}}
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert all(c["text"].startswith("q") for c in r.json()["choices"])
    assert threads and "kvshare-engine-loop" not in threads, threads
    assert len(threads) == 1, threads  # one matcher built; the 4 choices copy it
    assert callers == [callers[0]] and callers[0] != "kvshare-engine-loop", callers


# ---- 3. stop strings ------------------------------------------------------------------------------------------

class _Out:
    def __init__(self, text: str, finished: bool = False) -> None:
        self.text, self.finished = text, finished


def _brute_held(text: str, stops: list[str]) -> int:
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                best = max(best, k)
                break
    return best


def test_held_back_text_equals_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(300):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 5))]
        deltas, text, sent = TextDeltas(stops), "", ""
        for _ in range(30):
            text += rng.choice("abc")
            sent += deltas.next(_Out(text))
            assert sent == text[: len(text) - _brute_held(text, stops)], (stops, text)


def test_stop_matching_work_per_update_is_bounded() -> None:
    """256 stop strings of 1,024 characters, 400 updates of a growing text: under 1 s here (before:
    every update re-sliced every prefix of every stop, ~60 s)."""
    rng = random.Random(1)
    stops = ["".join(rng.choice("ab") for _ in range(1024)) for _ in range(256)]
    deltas = TextDeltas(stops)
    text = ""
    t0 = time.perf_counter()
    for _ in range(400):
        text += rng.choice("ab")
        deltas.next(_Out(text))
    assert time.perf_counter() - t0 < 1.0


def test_a_disconnect_aborts_every_choice(server: BackgroundServer) -> None:
    """n=8 streamed with 256 long stop strings; the client leaves after the first chunk: every
    choice is aborted within a second (before: the event loop sat in stop matching)."""
    engine = server.app.state.kvshare.loop.engine
    rng = random.Random(2)
    stops = ["".join(rng.choice("abcdefgh") for _ in range(1024)) for _ in range(256)]
    body = {"prompt": "Once", "n": 8, "max_tokens": 200, "ignore_eos": True, "stream": True, "stop": stops}

    async def run() -> float:
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", server.base_url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if '"text"' in line:
                        break
        left = time.monotonic()
        while engine.has_unfinished_requests():
            assert time.monotonic() - left < 10
            await asyncio.sleep(0.02)
        return time.monotonic() - left

    assert asyncio.run(run()) < 1.5


# ---- 4. fair steps and admission ----------------------------------------------------------------------------

def _seq(i: int, n: int, group: str | None = None) -> Sequence:
    s = Sequence(f"r{i}", None, list(range(1, n + 1)), SamplingParams(max_tokens=100), i)
    if group is not None:
        s.group = group  # type: ignore[attr-defined]
    return s


def test_a_long_prefill_beside_decodes_is_chunked() -> None:
    """A 2,000-token prompt arriving while a sequence decodes gets at most
    prefill_tokens_with_decodes tokens per step (before: the whole 2,048-token budget)."""
    bm = BlockManager(num_blocks=600, block_size=16, num_slots=4, max_model_len=4096)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=2048)
    sched.prefill_tokens_with_decodes = 12  # the server's default (`kvshare serve`)
    a = _seq(0, 4)
    sched.add(a)
    out = sched.schedule()
    a.num_computed += 4
    a.append_token(7, 0.0)
    sched.add(_seq(1, 2000))
    out = sched.schedule()
    lengths = {c.seq.request_id: c.length for c in out.chunks}
    assert lengths["r0"] == 1
    assert lengths["r1"] == 12


def test_one_group_cannot_hold_every_slot() -> None:
    """64 sequences of one request, then one of another: the newcomer is admitted at once (before:
    FCFS gave the first request every slot)."""
    bm = BlockManager(num_blocks=600, block_size=16, num_slots=16, max_model_len=256)
    sched = Scheduler(bm, max_num_seqs=16, max_num_batched_tokens=4096)
    for i in range(64):
        sched.add(_seq(i, 4, group="big"))
    sched.add(_seq(64, 4, group="new"))
    out = sched.schedule()
    admitted = [c.seq.request_id for c in out.chunks]
    assert "r64" in admitted
    assert sum(1 for c in out.chunks if c.seq.group == "big") == 16 // 2  # type: ignore[attr-defined]


def test_a_group_alone_leaves_the_reserve() -> None:
    """Alone, one request takes all slots but the reserve (max_num_seqs // 8), so a newcomer finds one."""
    bm = BlockManager(num_blocks=600, block_size=16, num_slots=16, max_model_len=256)
    sched = Scheduler(bm, max_num_seqs=16, max_num_batched_tokens=4096)
    for i in range(64):
        sched.add(_seq(i, 4, group="big"))
    out = sched.schedule()
    assert len(out.chunks) == sched.group_cap == 14
    sched.add(_seq(64, 4, group="new"))
    assert "r64" in [c.seq.request_id for c in sched.schedule().chunks]
    assert len(sched.running) == 15  # the newcomer only: "big" is over its share of 16 // 2


# ---- 6. bounded replies -------------------------------------------------------------------------------------

def test_replies_past_the_response_limit_are_413(server: BackgroundServer) -> None:
    url = server.base_url
    text = "ab" * (2 * 2**20 - 64)  # ~4 MB of text: ~4 M byte tokens
    r = httpx.post(url + "/tokenize", json={"prompt": text, "return_token_strs": True}, timeout=60)
    assert r.status_code == 413, r.status_code
    assert "max_response_bytes" in r.json()["error"]["message"] and len(r.content) < 1000
    limits = server.app.state.limits
    big = [[5] * 250] * 32  # 32 prompts x 250 tokens, echo + 20 logprobs each: ~7 MiB > 8 MiB with n=2
    r = httpx.post(url + "/v1/completions", json={"prompt": big, "n": 2, "echo": True, "logprobs": 20,
                                                  "max_tokens": 1}, timeout=60)
    assert r.status_code == 413, r.text
    assert r.json()["error"]["param"] == "echo" and limits.max_response_bytes == 8 * 2**20


def test_tokenize_runs_off_the_event_loop(server: BackgroundServer, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = server.app.state.kvshare.tokenizer
    real = tok.encode
    seen: list[str] = []
    monkeypatch.setattr(tok, "encode", lambda *a, **k: (seen.append(threading.current_thread().name), real(*a, **k))[1])
    r = httpx.post(server.base_url + "/tokenize", json={"prompt": "hello"}, timeout=30)
    assert r.status_code == 200 and r.json()["count"] >= 5
    assert seen and seen[0] != "kvshare-uvicorn", seen


# ---- 7. one-line 400s --------------------------------------------------------------------------------------------

BAD = [
    ({"logit_bias": {"²": 5}}, "logit_bias"),
    ({"logit_bias": {"٣": 5}}, "logit_bias"),
    ({"logit_bias": {"６５": 5}}, "logit_bias"),
    ({"allowed_token_ids": [True]}, "allowed_token_ids"),
    ({"prompt": [True, 5]}, "prompt"),
    ({"structured_outputs": {"regex": "(a{1000}){1000}"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": r"[^\s\S]"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": 'start: start "a"'}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "b+"}, "allowed_token_ids": [97]}, "allowed_token_ids"),
    ({"structured_outputs": {"json": "[" * 100_000}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "(" * 60_000 + ")" * 60_000 + "x("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "(" * 20_000 + "a" + ")" * 20_000 + "("}}, "structured_outputs.regex"),
]


@pytest.mark.parametrize("extra,param", BAD, ids=[p + str(i) for i, (_, p) in enumerate(BAD)])
def test_bad_inputs_are_one_line_400s(server: BackgroundServer, extra: dict[str, Any], param: str) -> None:
    body = {"prompt": "hi", "max_tokens": 3, **extra}
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == param, err
    assert "\n" not in err["message"] and len(err["message"]) <= 200, err["message"]
    assert "(((((" not in err["message"]  # never the input echoed back


# ---- 8. health -------------------------------------------------------------------------------------------------

class _StuckEngine:
    """An engine whose step blocks until `release` is set (a stopped tensor-parallel worker)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.pending = False

    def has_unfinished_requests(self) -> bool:
        return self.pending

    def add_request(self, request_id: str, prompt: Any, params: Any, cache_salt: Any = None) -> None:
        self.pending = True

    def abort_request(self, request_id: str) -> None:
        self.pending = False

    def step(self) -> list[Any]:
        self.release.wait(60)
        self.pending = False
        return []

    def stats(self) -> Any:
        raise RuntimeError("no stats")


def test_health_turns_503_within_seconds_of_a_stuck_step() -> None:
    """Before: 200 for the whole watchdog timeout (60 s)."""
    engine = _StuckEngine()
    app = create_app(engine, load_tokenizer(MODEL), MODEL, watchdog_timeout_s=60.0)
    with BackgroundServer(app) as srv:
        try:
            assert httpx.get(srv.base_url + "/health").status_code == 200
            threading.Thread(target=lambda: httpx.post(srv.base_url + "/v1/completions",
                                                       json={"prompt": [5, 6], "max_tokens": 2}, timeout=90),
                             daemon=True).start()
            t0 = time.monotonic()
            while httpx.get(srv.base_url + "/health").status_code == 200:
                assert time.monotonic() - t0 < 9, "/health still 200"
                time.sleep(0.2)
            assert "engine step" in httpx.get(srv.base_url + "/health").json()["error"]["message"]
        finally:
            engine.release.set()
