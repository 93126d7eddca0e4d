"""`kvshare serve --tensor-parallel-size 2` answers the `openai` client like TP=1, and Ctrl-C (SIGINT to the
whole process group, as a terminal sends it) leaves no process behind. Slow: two servers, one with workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from kvshare.parallel.group import free_port

pytestmark = pytest.mark.slow

PROMPTS = ["The cache is shared ", "abc", "tensor parallel: "]


def _session_members(sid: int) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":  # field 6 of stat: session id
                pids.append(int(d.name))
    return pids


def _serve(tp: int) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = [sys.executable, "-c", "import sys; from kvshare.cli import main; sys.exit(main())", "serve",
           "--model", "tiny-v41", "--random-weights", "--no-quantize", "--dtype", "float32", "--port", str(port),
           "--tensor-parallel-size", str(tp), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise AssertionError(f"server exited: {proc.stdout.read()}")
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError("server did not start")


def _answers(port: int) -> list[tuple[str, int]]:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
    out = []
    for p in PROMPTS:
        r = client.completions.create(model="tiny-v41", prompt=p, max_tokens=12, temperature=0)
        out.append((r.choices[0].text, r.usage.completion_tokens))
    chat = client.chat.completions.create(model="tiny-v41", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=8, temperature=0)
    out.append((chat.choices[0].message.content, chat.usage.completion_tokens))
    return out


def _ctrl_c(proc: subprocess.Popen) -> str:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return out


def test_serve_tp2_answers_like_tp1_and_leaves_nothing_behind() -> None:
    proc1, port1 = _serve(1)
    try:
        want = _answers(port1)
    finally:
        _ctrl_c(proc1)
    proc2, port2 = _serve(2)
    sid = os.getsid(proc2.pid)
    try:
        assert len(_session_members(sid)) >= 2  # the server and its worker
        got = _answers(port2)
    finally:
        out = _ctrl_c(proc2)
    assert got == want
    deadline = time.monotonic() + 10
    while _session_members(sid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _session_members(sid), out
