"""One cache plan: `kvshare plan MODEL` and an engine built for the same model and budget agree on
block size, block count and bytes, and the bytes are those the engine's pool actually allocates."""

from __future__ import annotations

import json

import pytest

from kvshare.cli import main
from kvshare.engine.engine import LLMEngine

MIB = 2**20


def _allocated_bytes(pool) -> int:
    """Bytes of the tensors the engine's pool holds (blocks and every ring), read off the tensors."""
    return pool.blocks.numel() * pool.blocks.element_size() + sum(r.numel() * r.element_size()
                                                                 for r in pool.rings.values())


@pytest.mark.parametrize("name,block", [("tiny-v41", 64), ("tiny-v4", 128)])
def test_plan_cli_and_engine_report_the_same_pool(name: str, block: int, capsys) -> None:
    assert main(["plan", name, "--memory", "3MiB", "--max-seqs", "3", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    pool = plan["pool"]
    eng = LLMEngine(name, gpu_memory_bytes=3 * MIB, max_num_seqs=3)
    assert pool["block_size"] == eng.layout.block_size == plan["layout"]["block_size"] == block
    assert pool["num_blocks"] == eng.pool.num_blocks == plan["layout"]["memory"]["blocks"]
    assert eng.stats().num_blocks_total == pool["num_blocks"] - 1  # the null block is not usable
    assert pool["total_bytes"] == _allocated_bytes(eng.pool) <= 3 * MIB
    assert pool["max_model_len"] == eng.max_model_len


def test_plan_default_block_size_is_the_engines(capsys) -> None:
    """Without --block-size the plan uses the engine's default (64 for V4.1-Flash), not its own."""
    assert main(["plan", "deepseek-v4.1-flash", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["layout"]["block_size"] == plan["pool"]["block_size"] == 64
