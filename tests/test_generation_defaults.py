"""Sampling defaults from generation_config.json, the CLI's sampling flags and seeds, and the
server's penalty / min_p fields."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from kvshare.cli.engine_args import add_engine_args
from kvshare.cli.generate import add_sampling_args, sampling_params_from
from kvshare.engine.generation_config import generation_defaults
from kvshare.errors import ConfigError


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_sampling_args(p)
    add_engine_args(p)
    return p.parse_args(argv)


def model_with(tmp_path: Path, gen: dict) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    return str(tmp_path)


def test_generation_defaults_read_known_keys(tmp_path):
    d = model_with(tmp_path, {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.2, "bos_token_id": 256,
                              "max_new_tokens": 9})
    assert generation_defaults(d) == {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.2}
    assert generation_defaults(model_with(tmp_path, {"do_sample": False, "temperature": 0.6}))["temperature"] == 0.0
    (tmp_path / "generation_config.json").unlink()
    assert generation_defaults(str(tmp_path)) == {}


@pytest.mark.parametrize("gen,field", [({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 2}, "min_p"),
                                       ({"top_p": 0}, "top_p")])
def test_bad_generation_config_names_file_and_field(tmp_path, gen, field):
    with pytest.raises(ConfigError, match=field) as e:
        generation_defaults(model_with(tmp_path, gen))
    assert "generation_config.json" in str(e.value)


def test_cli_flags_override_model_defaults_which_override_fallbacks(tmp_path):
    d = model_with(tmp_path, {"temperature": 0.6, "repetition_penalty": 1.2, "min_p": 0.05})
    p = sampling_params_from(parse(["--model", d, "--temperature", "0", "--presence-penalty", "0.5"]))
    assert (p.temperature, p.repetition_penalty, p.min_p, p.presence_penalty) == (0.0, 1.2, 0.05, 0.5)
    assert (p.top_p, p.top_k, p.frequency_penalty) == (1.0, 0, 0.0)  # fallbacks


def test_cli_bad_penalty_is_refused_with_its_name(tmp_path):
    from kvshare.errors import RequestError

    with pytest.raises(RequestError, match="frequency_penalty"):
        sampling_params_from(parse(["--model", str(tmp_path), "--frequency-penalty", "5"]))


def test_no_seed_draws_a_fresh_one_and_verbose_prints_it(tmp_path, capsys):
    seeds = set()
    for _ in range(3):
        args = parse(["--model", str(tmp_path), "--verbose"])
        p = sampling_params_from(args)
        assert isinstance(args.seed, int) and p.seed == args.seed  # the engine gets the same seed via args
        seeds.add(args.seed)
        assert f"seed: {args.seed}" in capsys.readouterr().err
    assert len(seeds) == 3  # three draws from 2**31 values
    args = parse(["--model", str(tmp_path), "--seed", "11"])
    assert sampling_params_from(args).seed == 11 and args.seed == 11


def run_generate(*extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvshare", "generate", "def ", "--model", "tiny-v41", "--max-tokens", "12",
           "--temperature", "1.0", "--quiet", "--verbose", "--random-weights", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)


def test_fresh_seed_run_is_reproduced_by_its_printed_seed():
    first = run_generate()
    line = next(x for x in first.stderr.splitlines() if x.startswith("seed: "))
    seed = int(line.split()[1])
    again = run_generate("--seed", str(seed))
    assert again.stdout == first.stdout and first.stdout.strip()


def test_server_fields_validate_and_reach_sampling_params():
    from kvshare.server.app import _sampling_params
    from kvshare.server.protocol import CompletionRequest

    for bad, field in [({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -9}, "frequency_penalty"),
                       ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.1}, "min_p")]:
        with pytest.raises(ValidationError, match=field):
            CompletionRequest(prompt="x", **bad)
    req = CompletionRequest(prompt="x", presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.3,
                            min_p=0.1)
    state = SimpleNamespace(max_model_len=64, default_max_tokens=8, sampling_defaults={})
    p = _sampling_params(state, req, None, 2, "prompt")
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p) == (0.5, -0.5, 1.3, 0.1)


def test_server_fills_unset_fields_from_the_model_defaults():
    """vLLM's behaviour: a request field the client leaves out takes the model's
    generation_config.json value; one the client sends (even the protocol default) wins."""
    from kvshare.server.app import _sampling_params
    from kvshare.server.protocol import CompletionRequest

    shipped = generation_defaults("kvshare-mini-v41")
    assert shipped == {"temperature": 0.7, "top_p": 0.95, "frequency_penalty": 0.2}  # the shipped file
    state = SimpleNamespace(max_model_len=64, default_max_tokens=8, sampling_defaults=shipped)
    p = _sampling_params(state, CompletionRequest(prompt="x"), None, 2, "prompt")
    assert (p.temperature, p.top_p, p.frequency_penalty, p.presence_penalty) == (0.7, 0.95, 0.2, 0.0)
    p = _sampling_params(state, CompletionRequest(prompt="x", temperature=1.0, frequency_penalty=0.0), None, 2,
                         "prompt")
    assert (p.temperature, p.top_p, p.frequency_penalty) == (1.0, 0.95, 0.0)
