"""schedule.choices on the shipped graphs: the validator asks for detokenize.in's capacity +
max_inflight_steps + 1 there (docs/stages.md), refuses less at load time, and every
shipped graph meets it."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from server_process import DEFAULT_GRAPH, REPO

from flowllm.cli.graph import validate_command
from flowllm.graph.problems import GraphValidationError
from flowllm.graph.spec import GraphSpec
from flowllm.graph.validator import ValidGraph, load_graph, validate_graph

SHIPPED = [DEFAULT_GRAPH, *sorted((REPO / "examples" / "graphs").glob("*.yaml"))]
CHOICES_EDGE = "{from: schedule.choices, to: detokenize.choices, capacity: 64}"


def validate(text: str, source: str = "g.yaml") -> ValidGraph:
    return validate_graph(GraphSpec.from_yaml(text, source=source, base_dir=DEFAULT_GRAPH.parent))


def with_choices(capacity: int) -> str:
    text = DEFAULT_GRAPH.read_text()
    assert CHOICES_EDGE in text
    return text.replace(CHOICES_EDGE, CHOICES_EDGE.replace("64", str(capacity)))


def choices_line() -> int:
    lines = DEFAULT_GRAPH.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if CHOICES_EDGE in line)


def test_the_default_graph_refuses_choices_below_detokenize_in_plus_the_credit_plus_one() -> None:
    with pytest.raises(GraphValidationError) as info:
        validate(with_choices(9))
    (problem,) = info.value.problems
    assert str(problem) == (
        f"g.yaml:{choices_line()}: cycle schedule -> detokenize -> schedule: channel "
        "'detokenize.choices' has capacity 9, below the 10 it needs: schedule.choices sends "
        "up to one message per step, and stage 'schedule' stops starting steps only once "
        "'detokenize.in' is full; give it capacity >= 10 (capacity 8 of 'detokenize.in' + "
        "the credit bound 1 of stage 'schedule' (max_inflight_steps) + 1)"
    )
    assert validate(with_choices(10)).channels["detokenize.choices"].capacity == 10


def test_the_bound_follows_max_inflight_steps() -> None:
    def two_steps(capacity: int) -> str:
        text = with_choices(capacity)
        assert "max_inflight_steps: 1" in text
        return text.replace("max_inflight_steps: 1", "max_inflight_steps: 2")

    with pytest.raises(GraphValidationError, match="capacity 10, below the 11 it needs"):
        validate(two_steps(10))
    assert validate(two_steps(11)).stages["schedule"].credit_bound == 2


@pytest.mark.parametrize("path", SHIPPED, ids=lambda path: path.name)
def test_every_shipped_graph_gives_choices_room_for_every_untaken_step(path: Path) -> None:
    graph = load_graph(path)
    credit = graph.stages["schedule"].credit_bound
    assert credit is not None
    needed = graph.channels["detokenize.in"].capacity + credit + 1
    assert graph.channels["detokenize.choices"].capacity >= needed


def test_small_queues_sits_at_the_bound() -> None:
    text = (REPO / "examples" / "graphs" / "small-queues.yaml").read_text()
    edge = "{from: schedule.choices, to: detokenize.choices, capacity: 4}"
    assert edge in text
    with pytest.raises(GraphValidationError, match="capacity 3, below the 4 it needs"):
        validate(text.replace(edge, edge.replace("4}", "3}")))


def test_graph_validate_prints_the_problem(tmp_path: Path) -> None:
    path = tmp_path / "shrunk.yaml"
    path.write_text(with_choices(9))
    out, err = io.StringIO(), io.StringIO()
    assert validate_command(path, out, err) == 1
    assert out.getvalue() == ""
    assert err.getvalue().startswith("1 problem in the graph:\n")
    assert (
        f"{path}:{choices_line()}: cycle schedule -> detokenize -> schedule: channel "
        "'detokenize.choices' has capacity 9, below the 10 it needs" in err.getvalue()
    )
