"""`kvshare plan`: Engram bytes (host-resident tables, and wkv + gates) beside weight and cache bytes.

The Engram total must be the 203,073,076,240 B that third parties measured from the release's
safetensors headers (spec/engram_dspark.md §1.2), and the backbone about the published 552B
parameters ("552B backbone + 196B Engram", spec/model.md §12 item 4).
"""

from __future__ import annotations

import json

import pytest

from kvshare.cli import main


def test_plan_shows_engram_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "deepseek-v4.1-flash", "--json"]) == 0
    w = json.loads(capsys.readouterr().out)["weights"]
    assert w["engram_table_bytes"] + w["engram_dense_bytes"] == 203_073_076_240
    assert w["engram_table_bytes"] == 196_613_849_600 + 6_144_182_800  # FP8 rows + e8m0 row scales
    assert w["engram_table_placement"] == "host"
    assert abs(w["params"] / 552e9 - 1) < 0.005 and w["bf16_bytes"] == 2 * w["params"]
    assert main(["plan", "deepseek-v4.1-flash"]) == 0
    text = capsys.readouterr().out
    assert "Engram tables (host memory)" in text and "202,758,032,400 B" in text and "weights (device" in text


def test_plan_without_engram_has_no_engram_rows(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "tiny-v41", "--json"]) == 0
    w = json.loads(capsys.readouterr().out)["weights"]
    assert w["engram_table_bytes"] == w["engram_dense_bytes"] == 0 and w["engram_table_placement"] is None
