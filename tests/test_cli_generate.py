"""`kvshare generate` / `kvshare chat` / engine flags, as a user runs them."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys

import pytest

from kvshare.cli import build_parser
from kvshare.cli.arg_types import parse_bytes
from kvshare.cli.engine_args import add_engine_args, engine_args_from


def test_generate_subprocess_streams_and_reports() -> None:
    # one intra-op thread: on a small shared CPU, torch's thread pool oversubscribes and crawls
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "kvshare", "generate", "def ", "--max-tokens", "8"],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("\n")
    report = proc.stderr
    assert "prefill: " in report and "tokens/s" in report
    assert "decode:  8 tokens" in report and "finish_reason=" in report
    assert "blocks used" in report


def test_generate_prints_the_same_text_alone_and_inside_a_batch_of_8(capsys: pytest.CaptureFixture) -> None:
    """With --batch-invariant a prompt's greedy text does not depend on the 7 others beside it
    (issue 24). Mutation caught: the engine ignoring batch_invariant (the 8-prompt run differs)."""
    from kvshare.cli import main

    flags = ["--temperature", "0", "--frequency-penalty", "0", "--max-tokens", "40", "--batch-invariant",
             "--max-num-batched-tokens", "16", "--quiet"]
    assert main(["generate", "def ", *flags]) == 0
    alone = capsys.readouterr().out
    others = ["import ", "class ", "    for ", "x = [", "# TODO", "return self.", "print("]
    assert main(["generate", *others[:3], "def ", *others[3:], *flags]) == 0
    batched = capsys.readouterr().out
    block = batched.split("--- [3] 'def '\n", 1)[1].split("\n--- [4]", 1)[0]
    assert block + "\n" == alone and len(alone) > 20


def test_generate_rejects_bad_sampling_values(capsys: pytest.CaptureFixture) -> None:
    from kvshare.cli import main

    assert main(["generate", "x", "--top-p", "0"]) == 2  # refused before any model is built
    assert "top_p" in capsys.readouterr().err


def test_engine_flags_map_to_engine_args() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    kw = engine_args_from(p.parse_args([]))
    assert kw == {"model": "kvshare-mini-v41"}
    kw = engine_args_from(p.parse_args(["--model", "tiny-v41", "--memory", "1GiB", "--block-size", "64",
                                        "--max-num-seqs", "4", "--max-num-batched-tokens", "512",
                                        "--max-model-len", "300", "--no-share-kv-cache", "--no-quantize",
                                        "--seed", "7", "--dtype", "float32", "--device", "cpu",
                                        "--kv-format", "bf16", "--batch-invariant"]))
    assert kw == {"model": "tiny-v41", "gpu_memory_bytes": 2**30, "block_size": 64, "max_num_seqs": 4,
                  "max_num_batched_tokens": 512, "max_model_len": 300, "share_kv_cache": False,
                  "quantize": False, "seed": 7, "dtype": "float32", "device": "cpu", "kv_format": "bf16",
                  "batch_invariant": True}
    assert engine_args_from(p.parse_args(["--num-blocks", "9"]))["num_blocks"] == 9
    with pytest.raises(SystemExit):
        p.parse_args(["--memory", "1GiB", "--num-blocks", "9"])  # one or the other


def test_every_engine_flag_has_help() -> None:
    for command in ("generate", "chat", "serve"):
        parser = build_parser()
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        for action in sub.choices[command]._actions:
            if action.option_strings and action.dest != "help":
                assert action.help and len(action.help) > 10, (command, action.dest)


@pytest.mark.parametrize("text,value", [("4GiB", 4 * 2**30), ("512MB", 512 * 10**6), ("1e9", 10**9),
                                        ("2g", 2 * 2**30), ("100", 100)])
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "lots", "-1", "3 parsecs", "0"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes(text)


def test_chat_keeps_the_conversation(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from kvshare.cli import main

    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n/reset\nfirst\nsecond\n/exit\nnever read\n"))
    seen: list[list[dict[str, str]]] = []
    from kvshare.tokenizer import ByteTokenizer

    real = ByteTokenizer.apply_chat_template

    def spy(self: ByteTokenizer, messages: list[dict[str, str]], **kw: object) -> object:
        seen.append([dict(m) for m in messages])
        return real(self, messages, **kw)

    monkeypatch.setattr(ByteTokenizer, "apply_chat_template", spy)
    rc = main(["chat", "--model", "tiny-v41", "--random-weights", "--max-tokens", "1", "--temperature", "0",
               "--max-model-len", "128", "--max-num-seqs", "1"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "(conversation reset)" in out
    assert [len(m) for m in seen] == [1, 1, 3]  # reset forgot "hello"; "second" sees the whole turn
    assert seen[2][0] == {"role": "user", "content": "first"} and seen[2][1]["role"] == "assistant"
    assert seen[2][2] == {"role": "user", "content": "second"}
