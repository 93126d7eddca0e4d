"""Speculative decoding through the public surfaces: LLM(speculative_config=...), engine.stats(),
`kvshare generate --speculative-config`, the `/metrics` exposition and the option's validation."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvshare.cli import main
from kvshare.cli.engine_args import add_engine_args, engine_args_from
from kvshare.engine.outputs import EngineStats
from kvshare.engine.sampling import SamplingParams
from kvshare.engine.spec_config import SpeculativeConfig
from kvshare.errors import ConfigError
from kvshare.llm import LLM
from kvshare.server.metrics import ServerMetrics

SPEC = {"method": "dspark", "num_speculative_tokens": 5}


def test_llm_with_speculative_config_matches_plain_and_reports_acceptance():
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[5, 9, 200, 3], [17] * 11]
    plain = LLM("tiny-v41-dspark").generate(prompts, params, use_tqdm=False)
    llm = LLM("tiny-v41-dspark", speculative_config=SPEC)
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    st = llm.engine.stats().extra
    assert st["spec_draft_tokens"] >= st["spec_num_verifies"] > 0
    assert st["spec_mean_accepted_length"] == 1 + st["spec_accepted_tokens"] / st["spec_num_verifies"]


def test_speculative_config_validation():
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse(json.dumps(SPEC)) == SpeculativeConfig("dspark", 5)
    for bad, field in (("{", "speculative_config"), ({"method": "ngram"}, "speculative_config.method"),
                       ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
                       ({"method": "dspark", "k": 3}, "speculative_config"), ([1], "speculative_config")):
        with pytest.raises(ConfigError) as e:
            SpeculativeConfig.parse(bad)
        assert e.value.field == field


def test_cli_flag_maps_to_engine_args():
    import argparse

    p = argparse.ArgumentParser()
    add_engine_args(p)
    kw = engine_args_from(p.parse_args(["--model", "tiny-v41-dspark", "--speculative-config", json.dumps(SPEC)]))
    assert kw["speculative_config"] == json.dumps(SPEC)


def test_generate_prints_acceptance_summary():
    proc = subprocess.run([sys.executable, "-m", "kvshare", "generate", "ab", "--model", "tiny-v41-dspark",
                           "--random-weights", "--max-tokens", "8", "--temperature", "0", "--ignore-eos",
                           "--speculative-config", json.dumps(SPEC)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "speculation: " in proc.stderr and "drafted" in proc.stderr and "mean accepted length" in proc.stderr


def test_generate_refuses_a_model_without_draft_stages(capsys):
    args = ["generate", "x", "--model", "tiny-v41", "--random-weights", "--speculative-config", json.dumps(SPEC)]
    assert main(args) != 0
    assert "no DSpark draft stages" in capsys.readouterr().err


def test_metrics_expose_speculation_counters():
    m = ServerMetrics()
    m.on_stats(EngineStats(extra={"spec_num_verifies": 4, "spec_draft_tokens": 20, "spec_accepted_tokens": 6,
                                  "spec_mean_accepted_length": 2.5}))
    text = m.render()
    assert "kvshare_engine_spec_draft_tokens_total 20" in text
    assert "kvshare_engine_spec_accepted_tokens_total 6" in text
    assert "kvshare_engine_spec_mean_accepted_length 2.5" in text


def test_plan_counts_draft_windows_and_ring_slack(capsys):
    """tiny-v41-dspark, K = 5: 2 stages x W = 8 rows of the 17-B FP8 window row (16 dims + scale);
    slack 5 rows on each of the 6 backbone windows (17 B) and on layer 2's ratio-2 compressor ring
    (kv and score, 16 fp32 each: 2 x 64 B per row)."""
    assert main(["plan", "tiny-v41-dspark", "--speculative-tokens", "5", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["speculation"] == {"num_speculative_tokens": 5, "draft_window_bytes_per_seq": 2 * 8 * 17,
                                   "slack_bytes_per_seq": 6 * 5 * 17 + 5 * 2 * 64}
    assert main(["plan", "deepseek-v4.1-flash", "--speculative-tokens", "5", "--json"]) == 0
    flash = json.loads(capsys.readouterr().out)["speculation"]
    assert flash["draft_window_bytes_per_seq"] == 3 * 128 * 528  # 3 stages, W = 128, 528-B FP8 rows
