"""How `flowllm serve` starts its processes: the supervisor reads the graph's file and
starts the engine core and the fronts without importing torch (the core imports it);
a graph whose stages do not validate is still one error and exit 1, said by the
supervisor once its processes have found it out, with nothing restarted; the step loop's
restart intensity read from the file is the validated graph's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flowllm.cli.processes import _validated_intensity, step_loop_intensity
from flowllm.engine import DEFAULT_GRAPH
from flowllm.engine.core import placement_of
from flowllm.graph.spec import GraphSpec
from flowllm.graph.validator import validate_graph

REPO = Path(__file__).resolve().parents[2]
SUPERVISOR_IMPORTS = """
import sys
from flowllm.cli import main, processes

def run(self):
    heavy = [m for m in ("torch", "transformers", "numpy", "litestar") if m in sys.modules]
    print("imported:", ",".join(heavy) or "-")
    return 0

processes.Supervisor.run = run
sys.exit(main(sys.argv[1:]))
"""


def serve(*args: str, script: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = ["-c", script] if script is not None else ["-m", "flowllm"]
    return subprocess.run(
        [sys.executable, *command, "serve", *args, "--port", "0", "--log-level", "warning"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )


def test_version_is_the_packages(capsys: pytest.CaptureFixture[str]) -> None:
    from flowllm.cli import main
    from flowllm.version import __version__

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"flowllm {__version__}\n"


def test_the_supervisor_starts_the_processes_without_importing_torch(
    gpt2_tiny_dir: Path,
) -> None:
    done = serve(str(gpt2_tiny_dir), script=SUPERVISOR_IMPORTS)
    assert done.returncode == 0, done.stderr
    assert "imported: -" in done.stdout


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        # Read from the file: the supervisor validates the graph whole before starting.
        (("use: flowllm.stages.ingest:Ingest", "usee: x"), "unknown key 'usee'"),
        # Found importing the stages: by the processes, then said by the supervisor.
        (("max_pending: 1024", "max_pending: lots"), "max_pending"),
    ],
)
def test_a_graph_that_does_not_validate_is_one_error_line(
    gpt2_tiny_dir: Path, tmp_path: Path, edit: tuple[str, str], problem: str
) -> None:
    graph = tmp_path / "bad.yaml"
    text = DEFAULT_GRAPH.read_text()
    assert edit[0] in text
    graph.write_text(text.replace(edit[0], edit[1], 1))
    done = serve(str(gpt2_tiny_dir), "--graph", str(graph))
    assert done.returncode == 1, done.stderr
    assert re.match(r"error: \d+ problems? in the graph:\n", done.stderr), done.stderr
    assert done.stderr.count("error: ") == 1 and problem in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "starting it again" not in done.stderr


@pytest.mark.parametrize(
    "edits",
    [
        [],  # the default graph: every core stage names its on_error
        [("group: step_loop,", "group: step_loop, max_restarts: 1, within_s: 9,")],
        # schedule's on_error left to its class: the stages are imported to learn it
        [("{on_error: restart, group: step_loop, timeout_s: 10}", "{group: step_loop}")],
    ],
)
def test_the_step_loops_intensity_is_the_validated_graphs(
    tmp_path: Path, edits: list[tuple[str, str]]
) -> None:
    text = DEFAULT_GRAPH.read_text()
    for old, new in edits:
        assert old in text
        text = text.replace(old, new)
    graph = tmp_path / "graph.yaml"
    graph.write_text(text)
    spec = GraphSpec.load(graph)
    core = placement_of(spec)[1]
    read = step_loop_intensity(spec, core)
    validated = _validated_intensity(validate_graph(spec), core)
    assert (read.max_restarts, read.within_s) == (validated.max_restarts, validated.within_s)
    if edits and "max_restarts: 1" in edits[0][1]:
        assert (read.max_restarts, read.within_s) == (1, 9.0)
