"""`flowllm graph validate` and `flowllm graph show`."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowllm.cli import graph as commands

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).resolve().parents[2]


def test_validate_ok_and_with_problems() -> None:
    out, err = io.StringIO(), io.StringIO()
    assert commands.validate_command(FIXTURES / "cycle_ok.yaml", out, err) == 0
    assert "graph 'loop' is valid: 5 stages, 5 edges, 5 channels" in out.getvalue()
    assert err.getvalue() == ""
    out, err = io.StringIO(), io.StringIO()
    assert commands.validate_command(FIXTURES / "many_problems.yaml", out, err) != 0
    assert out.getvalue() == ""
    report = err.getvalue()
    assert report.startswith("9 problems in the graph:")
    assert report.count("many_problems.yaml:") == 9  # the full list, one line each


def test_show_prints_a_listing_and_a_mermaid_chart() -> None:
    out, err = io.StringIO(), io.StringIO()
    assert commands.show_command(FIXTURES / "cycle_ok.yaml", False, out, err) == 0
    text = out.getvalue()
    assert "graph loop" in text
    loop_line = (
        "  loop     graph_toys:Loop       {max_inflight_steps: 2, steps: 5}  (credit bound 2)"
    )
    assert loop_line in text
    assert "in   requests: Item" in text and "out  steps: Step" in text
    assert "loop.steps -> execute.in  [Step, capacity 2]" in text
    assert "flowchart LR" in text
    assert 's1 -->|"steps → in<br/>Step [2]"| s2' in text

    out = io.StringIO()
    assert commands.show_command(FIXTURES / "cycle_ok.yaml", True, out, err) == 0
    assert out.getvalue().startswith("flowchart LR\n")
    assert "capacity" not in out.getvalue()


def test_show_without_a_file_uses_the_built_in_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(commands, "DEFAULT_GRAPH", FIXTURES / "pipeline.yaml")
    assert commands.show_command(None, True, out, err) == 0
    assert "flowchart LR" in out.getvalue()


def test_the_cli_exit_codes() -> None:
    env = dict(os.environ, PYTHONPATH=f"{Path(__file__).parent}{os.pathsep}{REPO}")
    ok = subprocess.run(
        [sys.executable, "-m", "flowllm", "graph", "validate", str(FIXTURES / "pipeline.yaml")],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "flowllm", "graph", "validate", str(FIXTURES / "unknown_port.yaml")],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=60,
    )
    assert bad.returncode == 1, bad.stderr
    assert "did you mean 'in'?" in bad.stderr, bad.stderr
    assert "did you mean 'sink'?" in bad.stderr
