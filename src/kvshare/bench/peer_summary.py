"""The peer table: kvshare, transformers and llama.cpp side by side on five throughputs (issue 26).

Built from the data of two sections of one run, nothing re-measured: the peer section (V4 peer
model; decode at batch 1 and at the largest batch, prefill at the largest batch) and the prefill
section (released attention sizes; batched decode and prefill of `prefill_batch` prompts). A
cell an engine did not run is None (printed "n/a"). The targets are issue 26's, stated against
llama.cpp and only added when llama.cpp ran.
"""

from __future__ import annotations

from typing import Any

from kvshare.bench.report import Section, Target

TARGET_DECODE_B1_VS_LLAMACPP = 1.0
TARGET_DECODE_BMAX_VS_LLAMACPP = 1.5
TARGET_PREFILL_VS_LLAMACPP = 3.0
TARGET_RELEASED_DECODE_VS_Q8 = 1.0


def _engines(result_sets: list[dict[str, Any]]) -> list[str]:
    """kvshare, transformers (if it ran), then every llama.cpp GGUF label seen, in first-seen order."""
    names = ["kvshare"]
    if any("transformers" in r for r in result_sets):
        names.append("transformers")
    for r in result_sets:
        names += [f"llama.cpp {k}" for k in r.get("llamacpp", {}) if f"llama.cpp {k}" not in names]
    return names


def _value(entry: dict[str, Any], engine: str, key: str) -> float | None:
    """`key` of `engine`'s result in a per-batch (or per-section) entry; None when it did not run."""
    if engine.startswith("llama.cpp "):
        lc = entry.get("llamacpp", {}).get(engine[len("llama.cpp "):])
        return None if lc is None else lc["result"][key]
    got = entry.get(engine)
    return None if got is None else got[key]


def summary_rows(peer: dict[str, Any], released: dict[str, Any] | None) -> tuple[list[str], list[list[Any]]]:
    """(engine names, rows): one row per throughput, one column per engine (see module docstring)."""
    runs = {r["batch"]: r for r in peer["runs"]}
    big = max(runs)
    sets = list(runs.values()) + ([released] if released else [])
    engines = _engines(sets)
    rows: list[list[Any]] = []
    if 1 in runs:
        rows.append(["decode tok/s, batch 1"] + [_value(runs[1], e, "decode_tok_s") for e in engines])
    rows.append([f"decode tok/s, batch {big}"] + [_value(runs[big], e, "decode_tok_s") for e in engines])
    rows.append([f"prefill tok/s, batch {big}"] + [_value(runs[big], e, "prefill_tok_s") for e in engines])
    if released:
        b = released["kvshare"]["batch"]
        length = released["kvshare"]["prompt_len"]
        rows.append([f"released attention sizes: decode tok/s, {b} sequences"]
                    + [_value(released, e, "decode_tok_s") for e in engines])
        rows.append([f"released attention sizes: prefill tok/s, {b} x {length}"]
                    + [_value(released, e, "prefill_tok_s") for e in engines])
    return engines, rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summary_section(peer: Section, released: Section | None, dtype: str) -> Section:
    """The side-by-side table with issue 26's targets against llama.cpp (`dtype` names kvshare's weights)."""
    engines, rows = summary_rows(peer.data, released.data if released is not None else None)
    sec = Section("peer-summary", f"kvshare, transformers and llama.cpp side by side ({dtype} weights; llama.cpp "
                  "also q8_0)", ["throughput"] + engines, rows,
                  data={"engines": engines, "released_sizes": released is not None})
    lc_base = next((e for e in engines if e.startswith("llama.cpp ") and not e.endswith("q8_0")), None)
    by_name = {r[0]: dict(zip(engines, r[1:])) for r in rows}
    runs = {r["batch"]: r for r in peer.data["runs"]}
    big = max(runs)
    if lc_base is not None:
        checks = [("decode tok/s, batch 1", TARGET_DECODE_B1_VS_LLAMACPP),
                  (f"decode tok/s, batch {big}", TARGET_DECODE_BMAX_VS_LLAMACPP),
                  (f"prefill tok/s, batch {big}", TARGET_PREFILL_VS_LLAMACPP)]
        for name, goal in checks:
            r = _ratio(by_name.get(name, {}).get("kvshare"), by_name.get(name, {}).get(lc_base))
            if r is not None:
                sec.targets.append(Target(f"{name}, kvshare / {lc_base}", r, goal, ">="))
    released_decode = next((v for k, v in by_name.items() if k.startswith("released attention sizes: decode")), None)
    if released_decode is not None:
        r = _ratio(released_decode.get("kvshare"), released_decode.get("llama.cpp q8_0"))
        if r is not None:
            sec.targets.append(Target("released attention sizes, decode tok/s, kvshare / llama.cpp q8_0", r,
                                      TARGET_RELEASED_DECODE_VS_Q8, ">="))
    sec.notes.append("from the peer and prefill sections of this run (each engine's best of the alternating runs)")
    return sec
