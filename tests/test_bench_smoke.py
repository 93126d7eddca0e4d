"""`kvshare bench`: a quick smoke run of every section (tiny sizes), and the full run (slow).

The quick run checks the harness end to end: tables print, JSON / markdown / plots are written,
the planner assertions of the sharing section hold, kvshare and transformers generate identical
greedy tokens on the same weights, and every measured time is positive.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kvshare.cli import main

SECTIONS = {"peer", "prefill", "peer-summary", "sharing", "context", "bandwidth", "speculation",
            "prefix"}  # what `bench all` runs


def _run(tmp_path: Path, *extra: str) -> dict:
    rc = main(["bench", "all", "--out-dir", str(tmp_path), "--name", "b", "--no-fetch", *extra])
    assert rc == 0
    return json.loads((tmp_path / "b.json").read_text())


def test_bench_quick_all_sections(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    plots = importlib.util.find_spec("matplotlib") is not None  # in the `test` extra; optional here
    # fp32, the oracle mode: greedy tokens must equal transformers' and rows are 4-byte
    # llama.cpp has its own tests (test_llamacpp_peer.py); here it stays out so nothing is converted
    out = _run(tmp_path, "--quick", "--dtype", "float32", "--no-llamacpp", *([] if plots else ["--no-plots"]))
    sections = {s["name"]: s for s in out["sections"]}
    assert set(sections) == SECTIONS
    summary = sections["peer-summary"]
    assert summary["columns"] == ["throughput", "kvshare", "transformers"] and len(summary["rows"]) == 5
    assert summary["rows"][0][1] == sections["peer"]["data"]["runs"][0]["kvshare"]["decode_tok_s"]
    for name in ("peer", "sharing", "context", "bandwidth"):
        assert not plots or (tmp_path / f"b-{name}.png").stat().st_size > 0
    assert "| target |" in (tmp_path / "b.md").read_text()

    for run in sections["peer"]["data"]["runs"]:
        assert run["tokens"]["identical"], run["tokens"]
        for side in ("kvshare", "transformers"):
            assert run[side]["decode_tok_s"] > 0 and run[side]["prefill_tok_s"] > 0

    prefill = sections["prefill"]["data"]
    assert prefill["tokens"]["identical"], prefill["tokens"]
    assert prefill["config"]["head_dim"] == 32 and prefill["kvshare"]["prefill_s"] > 0
    assert {t["name"].split(":")[0] for t in sections["prefill"]["targets"]} >= {
        "prefill time per token / batched decode time per token"}

    sharing = sections["sharing"]["data"]
    on, off = sharing["modes"]["on"], sharing["modes"]["off"]
    # By hand for the quick preset (8 layers: ratios 0,0,2,2,2,1,1,1; kv sources 2 and 5), fp32 rows
    # of head_dim 32 (128 B) and index_dim 16 (64 B). Shared: (128 + 64)/2 + (128 + 64)/1 = 288 B/token;
    # unshared: 3 x 96 + 3 x 192 = 864 B/token; factor 3.
    assert (on["bytes_per_token"], off["bytes_per_token"]) == (288, 864)
    assert on["planner"]["bytes_per_token"] == 288 and off["planner"]["bytes_per_token"] == 864
    assert sharing["bytes_factor"] == 3.0 == sharing["config_factor"]
    assert sharing["bytes_factor"] > 1 and on["max_seqs"] > off["max_seqs"]
    assert on["full_pool_tok_s"] > 0 and off["full_pool_tok_s"] > 0

    ctx = sections["context"]["data"]["rows"]
    assert [r["context"] for r in ctx] == sorted(r["context"] for r in ctx)
    assert all(r["step_s"] > 0 and r["dense_attention_s"] > 0 for r in ctx)
    assert sections["bandwidth"]["data"]["copy"]["read_gbps"] > 0
    pre = sections["prefix"]["data"]
    assert pre["tokens_equal"] and pre["computed_on"] < pre["computed_off"]
    assert pre["cached_reported"] == [pre["prefix_tokens"]] * pre["requests"]
    assert out["header"]["load_before"]["cpu_count"] >= 1

    spec = sections["speculation"]
    assert spec["data"]["plain_decode_tok_s"] > 0
    assert all(r["lossless"] and r["decode_tok_s"] > 0 for r in spec["data"]["rows"])
    assert all(t["met"] for t in spec["targets"]), spec["targets"]


def test_bench_single_section_without_peer(tmp_path: Path) -> None:
    rc = main(["bench", "sharing", "--quick", "--no-plots", "--out-dir", str(tmp_path), "--name", "s"])
    assert rc == 0
    out = json.loads((tmp_path / "s.json").read_text())
    assert [s["name"] for s in out["sections"]] == ["sharing"]
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.slow
def test_bench_full(tmp_path: Path) -> None:
    """The full benchmark (minutes): every section of `bench all` at the default sizes, each with
    its data and targets, the token checks holding."""
    out = _run(tmp_path)
    sections = {s["name"]: s for s in out["sections"]}
    assert set(sections) == SECTIONS
    assert all(sections[n]["data"] for n in SECTIONS)
    assert all(r["tokens"]["identical"] for r in sections["peer"]["data"]["runs"])
    assert sections["prefill"]["data"]["tokens"]["identical"]
    assert sections["prefix"]["data"]["tokens_equal"]
    assert all(r["lossless"] for r in sections["speculation"]["data"]["rows"])


def test_bench_speculation_section(tmp_path: Path) -> None:
    """Tokens/s with and without DSpark speculation; drafters agreeing at known rates are lossless
    and commit exactly their expected mean accepted length."""
    rc = main(["bench", "spec", "--quick", "--no-plots", "--out-dir", str(tmp_path), "--name", "sp"])
    assert rc == 0
    out = json.loads((tmp_path / "sp.json").read_text())
    (spec,) = out["sections"]
    rows = {r["drafter"]: r for r in spec["data"]["rows"]}
    assert spec["data"]["plain_decode_tok_s"] > 0 and len(rows) == 4
    assert all(r["lossless"] and r["decode_tok_s"] > 0 for r in rows.values())
    assert all(t["met"] for t in spec["targets"]), spec["targets"]
    assert rows["agrees for 5 of 5"]["mean_accepted_length"] > rows["agrees for 2 of 5"]["mean_accepted_length"] > 1
