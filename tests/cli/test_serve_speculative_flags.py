"""`flowllm serve --speculative-config`, without a server: what it parses to, and the
one-line error a bad value gets before the model loads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowllm.cli import build_parser
from flowllm.config import SpeculativeConfig
from flowllm.engine import DEFAULT_GRAPH, SPECULATIVE_GRAPH, graph_for_task
from flowllm.engine.args import config_from_args

REPO = Path(__file__).resolve().parents[2]


def test_the_flag_parses_as_vllms_and_picks_the_speculative_graph() -> None:
    args = build_parser().parse_args(
        ["serve", "m", "--speculative-config",
         '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, '
         '"prompt_lookup_min": 2}']
    )  # fmt: skip
    config = config_from_args(args)
    assert config.speculative == SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=5)
    assert config_from_args(build_parser().parse_args(["serve", "m"])).speculative is None
    assert graph_for_task("generate", speculative=True) == SPECULATIVE_GRAPH
    assert graph_for_task("generate") == DEFAULT_GRAPH


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ('{"method": "eagle"}',
         "speculative method must be one of ('ngram', 'draft_model'), got 'eagle'"),
        ('{"method": "draft_model"}', "model must name the draft model"),
        ('{"num_speculative_tokens": 99}', "num_speculative_tokens must be in [1, 16], got 99"),
        ('{"prompt_lookup_max": 1}', "prompt_lookup_max (1) must be >= prompt_lookup_min (2)"),
        (f'{{"prompt_lookup_max": {2**63}}}', f"prompt_lookup_max must be <= 64, got {2**63}"),
        ('{"num_speculative_tokens": ' + "9" * 400 + "}", "num_speculative_tokens"),
        ("ngram", "JSON is malformed"),
    ],
)  # fmt: skip
def test_bad_values_are_one_error_before_the_model_loads(
    tmp_path: Path, value: str, said: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "flowllm", "serve", str(tmp_path / "no-model-here"),
         "--speculative-config", value, "--port", "0"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert f"error: --speculative-config: {said}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_draft_model_that_does_not_resolve_is_one_error_before_anything_starts(
    tmp_path: Path, gpt2_tiny_dir: Path
) -> None:
    """The supervisor checks the draft (without torch) before it starts the engine core."""
    missing = tmp_path / "no-draft-here"
    done = subprocess.run(
        [sys.executable, "-m", "flowllm", "serve", str(gpt2_tiny_dir),
         "--speculative-config", f'{{"model": "{missing}"}}', "--port", "0"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    said = f"error: --speculative-config: model: model {str(missing)!r} does not exist"
    assert said in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
