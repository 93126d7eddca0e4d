"""The side-by-side peer table (bench/peer_summary.py) from hand-made section data.

Pure Python, no engine runs: every cell must be the number the peer / prefill section recorded for
that engine, a missing engine is None ("n/a" when printed), and the issue-26 targets are the
ratios computed by hand below.
"""

from __future__ import annotations

from typing import Any

from kvshare.bench.peer_summary import summary_rows, summary_section
from kvshare.bench.report import Section, fmt, markdown


def _res(decode: float, prefill: float, batch: int = 1, prompt_len: int = 256) -> dict[str, Any]:
    return {"decode_tok_s": decode, "prefill_tok_s": prefill, "batch": batch, "prompt_len": prompt_len}


def _peer_data(with_tf: bool = True, with_lc: bool = True) -> dict[str, Any]:
    runs = []
    for b, (kv, tf, bf, q8) in {1: ((30.0, 2000.0), (28.0, 1900.0), (100.0, 500.0), (120.0, 400.0)),
                                8: ((150.0, 1700.0), (140.0, 1000.0), (180.0, 460.0), (185.0, 390.0))}.items():
        entry: dict[str, Any] = {"batch": b, "kvshare": _res(*kv, batch=b)}
        if with_tf:
            entry["transformers"] = _res(*tf, batch=b)
        if with_lc:
            entry["llamacpp"] = {"bf16": {"result": _res(*bf, batch=b)}, "q8_0": {"result": _res(*q8, batch=b)}}
        runs.append(entry)
    return {"runs": runs}


def _released(with_lc: bool = True) -> dict[str, Any]:
    d: dict[str, Any] = {"kvshare": _res(70.0, 800.0, batch=8), "transformers": _res(60.0, 600.0, batch=8)}
    if with_lc:
        d["llamacpp"] = {"bf16": {"result": _res(105.0, 270.0, batch=8)},
                         "q8_0": {"result": _res(128.0, 250.0, batch=8)}}
    return d


def test_rows_take_each_engines_recorded_numbers() -> None:
    engines, rows = summary_rows(_peer_data(), _released())
    assert engines == ["kvshare", "transformers", "llama.cpp bf16", "llama.cpp q8_0"]
    assert rows == [
        ["decode tok/s, batch 1", 30.0, 28.0, 100.0, 120.0],
        ["decode tok/s, batch 8", 150.0, 140.0, 180.0, 185.0],
        ["prefill tok/s, batch 8", 1700.0, 1000.0, 460.0, 390.0],
        ["released attention sizes: decode tok/s, 8 sequences", 70.0, 60.0, 105.0, 128.0],
        ["released attention sizes: prefill tok/s, 8 x 256", 800.0, 600.0, 270.0, 250.0],
    ]


def test_missing_engines_and_sections() -> None:
    engines, rows = summary_rows(_peer_data(with_tf=False, with_lc=False), None)
    assert engines == ["kvshare"]
    assert [r[0] for r in rows] == ["decode tok/s, batch 1", "decode tok/s, batch 8", "prefill tok/s, batch 8"]
    # llama.cpp only in the released-sizes section: its peer-model cells are None, printed "n/a"
    engines, rows = summary_rows(_peer_data(with_lc=False), _released())
    assert engines[2:] == ["llama.cpp bf16", "llama.cpp q8_0"]
    assert rows[0][3:] == [None, None] and rows[3][3:] == [105.0, 128.0]
    assert fmt(None) == "n/a"


def test_targets_are_issue_26_ratios() -> None:
    peer = Section("peer", "t", [], data=_peer_data())
    rel = Section("prefill", "t", [], data=_released())
    sec = summary_section(peer, rel, "bfloat16")
    got = {t.name: (t.value, t.threshold, t.met) for t in sec.targets}
    assert got == {
        "decode tok/s, batch 1, kvshare / llama.cpp bf16": (30.0 / 100.0, 1.0, False),
        "decode tok/s, batch 8, kvshare / llama.cpp bf16": (150.0 / 180.0, 1.5, False),
        "prefill tok/s, batch 8, kvshare / llama.cpp bf16": (1700.0 / 460.0, 3.0, True),
        "released attention sizes, decode tok/s, kvshare / llama.cpp q8_0": (70.0 / 128.0, 1.0, False),
    }
    assert "| released attention sizes: prefill tok/s, 8 x 256 | 800 | 600 | 270 | 250 |" in markdown([sec])
    # without llama.cpp there is nothing to state the targets against
    assert summary_section(Section("peer", "t", [], data=_peer_data(with_lc=False)), None, "bfloat16").targets == []
