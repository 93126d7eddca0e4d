"""The command line's restart with glibc's huge-page tunable (kvshare/hugepages.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvshare import hugepages


def _offered(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    monkeypatch.setattr(hugepages, "_thp_offered", lambda: on)
    monkeypatch.setattr(hugepages, "_glibc_at_least", lambda major, minor: on)
    monkeypatch.setattr(hugepages.sys, "platform", "linux" if on else "darwin")


def test_wanted_only_where_offered_and_not_set_or_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _offered(monkeypatch, True)
    assert hugepages.wanted({})
    assert not hugepages.wanted({"KVSHARE_HUGEPAGES": "off"})
    assert not hugepages.wanted({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})  # the user's own choice stays
    _offered(monkeypatch, False)
    assert not hugepages.wanted({})


def test_the_tunable_is_added_to_the_existing_ones() -> None:
    assert hugepages.with_tunable({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    env = hugepages.with_tunable({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "X": "y"})
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", "X": "y"}


def test_the_restart_runs_the_same_command_with_the_tunable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation caught: the restart dropping the arguments (the call's argv here)."""
    calls = []
    monkeypatch.setattr(hugepages.os, "execve", lambda *a: calls.append(a))
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("KVSHARE_HUGEPAGES", raising=False)
    _offered(monkeypatch, True)
    hugepages.reexec_if_wanted(["serve", "--port", "9"])
    (exe, args, env), = calls
    assert exe == sys.executable and args == [sys.executable, "-m", "kvshare", "serve", "--port", "9"]
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    monkeypatch.setenv("KVSHARE_HUGEPAGES", "off")
    hugepages.reexec_if_wanted(["serve"])
    assert len(calls) == 1


def test_the_command_line_restarts_once_with_the_tunable(tmp_path) -> None:  # noqa: ANN001
    """A real ``kvshare --version``: every Python process started reports its GLIBC_TUNABLES (a
    sitecustomize on the path); where the machine offers huge pages the command runs twice, the
    second time with the tunable, and then stops (no loop), printing what it prints without it."""
    (tmp_path / "sitecustomize.py").write_text("import os\nprint('START', os.environ.get('GLIBC_TUNABLES'))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "KVSHARE_HUGEPAGES")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-m", "kvshare", "--version"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    starts = [line for line in out.stdout.splitlines() if line.startswith("START")]
    if hugepages.wanted(env):
        assert starts == ["START None", "START glibc.malloc.hugetlb=1"]
    else:
        assert starts == ["START None"]
    off = subprocess.run([sys.executable, "-m", "kvshare", "--version"], capture_output=True, text=True,
                         env={**env, "KVSHARE_HUGEPAGES": "off"}, timeout=120)
    assert off.returncode == 0 and off.stdout.splitlines() == ["START None", out.stdout.splitlines()[-1]]
