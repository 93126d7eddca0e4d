"""`kvshare plan --tensor-parallel-size N`: per-rank weight, cache and Engram bytes against a hand computation."""

from __future__ import annotations

import json

import pytest

from kvshare.cli import main

# deepseek-v4.1-flash (shipped config): layers, heads x head_dim, q_lora, o_groups x o_lora, hidden,
# routed experts x moe_intermediate, vocab.
L, H, HD, QL, G, OL, D, E, I, V = 40, 64, 512, 1280, 8, 1024, 5120, 384, 2304, 129280


def _primes_above(n: int, count: int) -> list[int]:
    """The `count` smallest primes above `n`, by trial division."""
    out: list[int] = []
    while len(out) < count:
        n += 1
        if n % 2 and all(n % d for d in range(3, int(n ** 0.5) + 1, 2)):
            out.append(n)
    return out


def _plan(capsys: pytest.CaptureFixture[str], *extra: str) -> dict:
    assert main(["plan", "deepseek-v4.1-flash", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_tp8_per_rank_by_hand(capsys: pytest.CaptureFixture[str]) -> None:
    plan = _plan(capsys, "--tensor-parallel-size", "8")
    tp = plan["tensor_parallel"]
    total = tp["total_weight_params"]
    # Sharded over 8 ranks (B.4): per layer wq_b, sinks, wo_a, wo_b and the routed experts; embed and head.
    per_layer = QL * H * HD + H + (G * OL) * (H * HD // G) + D * (G * OL) + E * 3 * D * I
    sharded = L * per_layer + 2 * V * D
    per_rank = total - sharded + sharded // 8
    assert [r["weight_params"] for r in tp["ranks"]] == [per_rank] * 8
    assert tp["ranks"][0]["weight_bytes"] == 2 * per_rank  # bf16
    # Engram tables are split by hash columns (engram_dspark.md §1.11): 24 columns, 3 per rank. Layer 1's
    # columns use the 24 smallest primes above 15,999,999 in order, layer 14's the next 24 (§1.1, §1.4);
    # a row is 256 FP8 bytes + 8 ue8m0 scales.
    p = _primes_above(15_999_999, 48)
    assert (sum(p[:24]), sum(p[24:])) == (384_006_168, 384_016_682)  # the published row counts
    want = [(sum(p[3 * r:3 * r + 3]) + sum(p[24 + 3 * r:24 + 3 * r + 3])) * 264 for r in range(8)]
    assert [r["engram_table_bytes"] for r in tp["ranks"]] == want
    assert sum(want) == (384_006_168 + 384_016_682) * 264
    # Caches are replicated: the per-rank cache figures are TP=1's.
    assert plan["layout"] == _plan(capsys)["layout"]


def test_plan_tp1_holds_everything(capsys: pytest.CaptureFixture[str]) -> None:
    tp = _plan(capsys)["tensor_parallel"]
    assert tp["ranks"][0]["weight_params"] == tp["total_weight_params"]
    assert tp["ranks"][0]["engram_table_bytes"] == (384_006_168 + 384_016_682) * 264


def test_plan_tp_must_divide(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "deepseek-v4.1-flash", "--tensor-parallel-size", "3"]) != 0
    assert "num_attention_heads" in capsys.readouterr().err
