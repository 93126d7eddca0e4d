"""What a newcomer meets (issue 16): one-line errors instead of tracebacks, a fast `--help`,
`--version`, Ctrl-C that cancels a chat reply but keeps the conversation, `bench` without its
optional extras and without touching the committed results."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvshare import __version__
from kvshare.cli import build_parser, main

CLI = [sys.executable, "-c", "import sys; from kvshare.cli import main; sys.exit(main())"]


def one_line_error(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return err.splitlines()[-1]


def test_help_does_not_import_torch() -> None:
    code = ("import sys\nfrom kvshare.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'fastapi', 'pydantic', 'uvicorn') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert "HEAVY []" in out, out


def test_version(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"kvshare {__version__}"


def test_bad_port_is_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", "--port", "99999"])
    assert e.value.code == 2
    assert "a TCP port is 1-65535, got 99999" in one_line_error(capsys)


def test_cuda_on_a_cpu_build_is_one_line(capsys: pytest.CaptureFixture) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    assert main(["generate", "x", "--device", "cuda", "--max-tokens", "1"]) == 2
    err = one_line_error(capsys)
    assert err.startswith("error: --device cuda: no CUDA GPU") and "--device cpu" in err


def test_too_small_pool_names_the_flags(capsys: pytest.CaptureFixture) -> None:
    assert main(["generate", "x", "--model", "tiny-v41", "--random-weights", "--num-blocks", "1"]) == 2
    err = one_line_error(capsys)
    assert "--memory" in err and "--num-blocks" in err and "gpu_memory_bytes" in err
    assert main(["generate", "x", "--model", "tiny-v41", "--random-weights", "--num-blocks", "3",
                 "--block-size", "64", "--max-model-len", "1000"]) == 2
    assert "--max-model-len" in one_line_error(capsys)


def test_ctrl_c_in_generate_exits_130(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    import kvshare.cli.generate as gen

    def interrupted(*a: Any, **k: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(gen, "stream_request", interrupted)
    assert main(["generate", "x", "--model", "tiny-v41", "--random-weights", "--max-tokens", "1"]) == 130
    assert one_line_error(capsys) == "interrupted"


class _InterruptingOut(io.StringIO):
    """stdout whose next write raises KeyboardInterrupt once `armed` (Ctrl-C mid-reply)."""

    armed = False

    def write(self, s: str) -> int:
        if self.armed and s and not s.startswith("\n("):
            self.armed = False
            raise KeyboardInterrupt
        return super().write(s)


def test_ctrl_c_cancels_the_reply_and_keeps_the_conversation() -> None:
    from kvshare.cli.chat import chat_loop
    from kvshare.engine.engine import LLMEngine
    from kvshare.engine.sampling import SamplingParams
    from kvshare.tokenizer import ByteTokenizer, load_tokenizer

    tok = load_tokenizer("tiny-v41")
    assert isinstance(tok, ByteTokenizer)
    engine = LLMEngine("tiny-v41", tokenizer=tok, max_model_len=256, max_num_seqs=2)
    seen: list[list[dict[str, str]]] = []
    real = tok.apply_chat_template
    tok.apply_chat_template = lambda messages, **kw: (seen.append([dict(m) for m in messages]),  # type: ignore
                                                      real(messages, **kw))[1]
    out = _InterruptingOut()
    lines = iter(["first", "second", "third", "/exit"])

    def read() -> str:
        line = next(lines)
        out.armed = line == "second"
        return line

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    messages = chat_loop(engine, tok, params, read, out)
    assert "(reply cancelled; the conversation is kept)" in out.getvalue()
    assert [m["content"] for m in seen[2]][::2] == ["first", "third"]  # "second" was dropped, "first" kept
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert not engine.has_unfinished_requests() and engine.blocks.allocator.num_used == 0


def test_bench_defaults_do_not_touch_committed_results() -> None:
    args = build_parser().parse_args(["bench"])
    assert args.out_dir != Path("benchmarks/results")


def test_bench_runs_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("matplotlib", "transformers") else real(name, *a))
    assert main(["bench", "sharing", "--quick", "--out-dir", str(tmp_path), "--name", "b"]) == 0
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert (tmp_path / "b.json").is_file() and not list(tmp_path.glob("*.png"))


def test_model_too_big_for_memory_is_refused_before_allocation(capsys: pytest.CaptureFixture) -> None:
    import time

    t0 = time.perf_counter()
    assert main(["generate", "x", "--model", "deepseek-v4-pro", "--random-weights"]) == 2
    assert time.perf_counter() - t0 < 10  # counted from the config, nothing built
    err = one_line_error(capsys)
    assert "GiB of weights" in err and "kvshare plan" in err
