"""`kvshare plan`: JSON numbers equal hand-derived byte counts; tables; memory parsing; errors."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvshare.cli import main
from kvshare.cli.arg_types import parse_bytes as parse_memory
from kvshare.shipped import CONFIG_DIR

ARGS = ["plan", "deepseek-v4.1-flash", "--memory", "80GiB", "--max-seqs", "64", "--json", "--block-size", "128"]
MEM = 80 * 2**30


def _check_against_layout(plan: dict) -> None:
    """Every number against a value derived by hand (spec/cache.md §4), not against CacheLayout."""
    got = plan["layout"]
    assert got["bytes_per_block"] == 113_920 and got["bytes_per_token"] == 890
    assert got["unshared_bytes_per_token"] == 10_324 and got["unshared_bytes_per_block"] == 10_324 * 128
    assert got["saving_factor"] == pytest.approx(10_324 / 890, rel=1e-15)
    # Per owner (ratio 2 or 1 at block 128): 64 or 128 rows of 68-B index keys, then of 288-B KV.
    assert [(r["owner"], r["kind"], r["offset"], r["end"]) for r in got["regions"]] == [
        (2, "index_k", 0, 4352), (2, "kv", 4352, 22784), (8, "index_k", 22784, 27136), (8, "kv", 27136, 45568),
        (14, "index_k", 45568, 49920), (14, "kv", 49920, 68352), (20, "index_k", 68352, 77056),
        (20, "kv", 77056, 113_920)]
    # Windows: 40 backbone + 3 draft layers x 128 rows x 528 B; compressors: 3 ratio-2 sources x
    # (kv, score) x 2 rows x 512 fp32 = 24 KiB.
    window = 43 * 128 * 528
    assert got["window_bytes_per_seq_backbone"] == 40 * 128 * 528 == 2_703_360
    assert got["compressor_bytes_per_seq"] == 3 * 2 * 2 * 512 * 4 == 24 * 1024
    assert got["state_bytes_per_seq"] == window + 24 * 1024 == 2_930_688
    mem = got["memory"]
    free = MEM - 64 * 2_930_688
    assert mem["state_bytes_total"] == 64 * 2_930_688
    assert mem["blocks"] == free // 113_920 == 752_385
    assert mem["tokens"] == (752_385 - 1) * 128  # block 0 is the null block
    assert mem["unshared_tokens"] == (free // (10_324 * 128) - 1) * 128
    assert plan["roles"] == {"swa": 2, "full": 4, "reindex": 4, "reuse": 30}
    rows = {r["layer"]: r for r in plan["layers"]}
    assert len(rows) == 43
    assert (rows[24]["role"], rows[24]["kv_source"], rows[24]["index_k_source"], rows[24]["uses_candidates"]) == (
        "reindex", 20, 20, True)
    assert rows[20]["publishes_candidates"] and rows[20]["regions"] == ["index_k", "kv"]
    assert rows[3]["regions"] == [] and rows[3]["kv_cache"] == 2
    assert "compressor" not in rows[20]["state"] and rows[2]["state_bytes"] == 128 * 528 + 8192


def test_plan_json_via_main(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(ARGS) == 0
    _check_against_layout(json.loads(capsys.readouterr().out))


def test_plan_json_via_subprocess() -> None:
    out = subprocess.run([sys.executable, "-m", "kvshare", *ARGS], capture_output=True, text=True, check=True,
                         timeout=120)
    _check_against_layout(json.loads(out.stdout))


def test_plan_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "deepseek-v4.1-flash", "--memory", "80GiB", "--max-seqs", "64", "--block-size", "128"]) == 0
    out = capsys.readouterr().out
    for text in ("113,920", "890 B", "10,324", "11.60x", "reindex", "publishes", "consumes", "77,056",
                 "tokens that fit", "per-sequence state"):
        assert text in out, text


def test_plan_no_share_and_formats(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "deepseek-v4.1-flash", "--no-share", "--json"]) == 0
    lay = json.loads(capsys.readouterr().out)["layout"]
    assert lay["bytes_per_token"] == 10_324 and lay["saving_factor"] == 1.0 and not lay["share_cache"]
    assert "memory" not in lay
    assert main(["plan", "deepseek-v4.1-flash", "--kv-format", "fp8_v4", "--index-format", "fp8",
                 "--block-size", "256", "--json"]) == 0
    lay = json.loads(capsys.readouterr().out)["layout"]
    assert (lay["bytes_per_token"], lay["bytes_per_block"]) == (1790, 458_240)


def test_plan_config_as_path_and_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text((CONFIG_DIR / "tiny-v4.json").read_text())
    assert main(["plan", str(tmp_path), "--json", "--block-size", "128"]) == 0
    a = json.loads(capsys.readouterr().out)["layout"]
    assert main(["plan", str(tmp_path / "config.json"), "--json"]) == 0
    b = json.loads(capsys.readouterr().out)["layout"]
    assert a == b and a["formats"]["kv"]["name"] == "fp8_v4"


@pytest.mark.parametrize("args,needle", [
    (["plan", "tiny-v41", "--block-size", "3"], "block_size"),
    (["plan", "tiny-v41", "--kv-format", "int3"], "kv_format"),
    (["plan", "no-such-model"], "shipped config"),
])
def test_plan_errors_are_clear(args: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["80XB", "abc", "", "-5GiB", "0", "GiB", "nan", "1e400"])
def test_bad_memory_is_an_argparse_error(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["plan", "tiny-v41", f"--memory={bad}"])
    assert e.value.code == 2
    assert "invalid memory size" in capsys.readouterr().err


@pytest.mark.parametrize("text,value", [
    ("80GiB", 80 * 2**30), ("512MiB", 512 * 2**20), ("1e9", 10**9), ("40GB", 40 * 10**9), ("4G", 4 * 2**30),
    ("1.5TiB", 3 * 2**39), ("1024", 1024), ("64 KiB", 65536), ("2kb", 2000), ("7b", 7),
])
def test_parse_memory(text: str, value: int) -> None:
    assert parse_memory(text) == value


def test_parse_memory_rejects() -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_memory("0.5")


def test_plan_shows_the_published_v4_flash_figure_before_padding(capsys) -> None:
    """V4-Flash: 3,514.25 B/token of rows (the paper's 3,514); a 1-row ratio-128 region pads to 608 B."""
    assert main(["plan", "deepseek-v4-flash"]) == 0
    out = capsys.readouterr().out
    assert "3,514.25 B" in out and "3,518 B" in out
