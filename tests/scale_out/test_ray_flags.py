"""The scale-out flags' errors: one line and exit 1, before any Ray process starts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flowllm.cli import main
from flowllm.engine.async_engine import DEFAULT_GRAPH

RAY = ["--distributed-executor-backend", "ray"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--data-parallel-size", "2"], "--data-parallel-size needs --distributed-executor"),
        ([*RAY, "--data-parallel-size", "0"], "must be between 1 and 1024"),
        ([*RAY, "--data-parallel-size", str(2**63)], "must be between 1 and 1024"),
        ([*RAY, "--data-parallel-size", "9" * 400], "must be between 1 and 1024"),
        ([*RAY, "--cpus-per-replica", "0"], "must be > 0"),
        ([*RAY, "--cpus-per-replica", "nan"], "must be > 0"),
        ([*RAY, "--cpus-per-replica", "inf"], "must be > 0"),
        ([*RAY, "--routing-imbalance-bound", "-1"], "must be >= 0"),
        ([*RAY, "--trace-dir", "t"], "--trace-dir not supported"),
        ([*RAY, "--api-key", ""], "--api-key is empty"),
        ([*RAY, "--enable-auto-tool-choice"], "needs --tool-call-parser"),
        ([*RAY, "--max-model-len", "0"], "max_model_len"),
        ([*RAY, "--api-server-count", "2"], "--api-server-count not supported"),
    ],
)
def test_bad_flags_are_one_line_errors(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_the_graph_must_be_placed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A replica is the graph's core process: a graph in one process has none."""
    unplaced = re.sub(r"process: (front|core), *", "", DEFAULT_GRAPH.read_text())
    assert "process:" not in unplaced
    graph = tmp_path / "unplaced.yaml"
    graph.write_text(unplaced)
    assert main(["serve", *RAY, "--graph", str(graph)]) == 1
    err = capsys.readouterr().err
    assert "needs a graph placed in a front and a core process" in err and err.count("\n") == 1


def test_routing_must_be_known(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", *RAY, "--routing", "random"])
    assert "invalid choice: 'random'" in capsys.readouterr().err


def test_a_bad_draft_model_is_refused_before_ray_starts(
    gpt2_tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = f'{{"model": "{tmp_path / "nowhere"}"}}'
    flags = [str(gpt2_tiny_dir), *RAY, "--speculative-config", spec]
    assert main(["serve", *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --speculative-config: ") and err.count("\n") == 1, err
    assert "does not exist" in err
