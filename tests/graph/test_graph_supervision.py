"""Supervision: a failing stage fails one request, a group restarts, too many failures
escalate, and the watchdog cancels a stage stuck on one message."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from test_graph_runtime import make_graph, quiet_logger, run

from flowllm.graph.problems import GraphValidationError
from flowllm.graph.render import render_text
from flowllm.graph.spec import GraphSpec
from flowllm.graph.validator import validate_graph

JOBS = "supervision_toys:Jobs"
FLAKY = "supervision_toys:Flaky"
TALLY = "supervision_toys:Tally"
DONE = "supervision_toys:Done"


def jobs(count: int) -> list[str]:
    return [f"r{n}" for n in range(count)]


def metric(graph: Any, name: str, labels: dict[str, str]) -> float | None:
    value = graph.registry.get_sample_value(name, labels)
    return None if value is None else float(value)


def pipeline(middle: str, count: int = 20, delay: float = 0.0) -> str:
    return f"""
        stages:
          - {{name: jobs, use: "{JOBS}", with: {{count: {count}, delay: {delay}}}}}
          {middle}
          - {{name: done, use: "{DONE}"}}
        edges:
          - jobs.out -> work.in
          - work.out -> done.in
          - work.errors -> done.errors
    """


def test_a_per_request_failure_fails_that_request_only() -> None:
    services: dict[str, Any] = {}
    graph = make_graph(
        pipeline(f'- {{name: work, use: "{FLAKY}", with: {{fail_at: [3, 11]}}}}'), services
    )
    run(graph)
    assert graph.failure is None
    assert sorted(services["failed"]) == ["r11", "r3"]
    error = services["failed"]["r3"]
    assert error.kind == "internal"
    assert "work" in error.message and "RuntimeError" in error.message
    assert sorted(services["completed"]) == sorted(set(jobs(20)) - {"r3", "r11"})
    assert metric(graph, "flowllm:stage_errors_total", {"stage": "work"}) == 2


def test_the_requests_own_input_is_a_400_and_does_not_count() -> None:
    services: dict[str, Any] = {}
    graph = make_graph(
        pipeline(
            f'- {{name: work, use: "{FLAKY}", with: {{refuse_at: [1, 2, 3, 4, 5, 6, 7]}},'
            " supervision: {max_restarts: 1}}"
        ),
        services,
    )
    run(graph)
    assert graph.failure is None  # seven refusals, yet within an intensity of one
    assert sorted(services["failed"]) == sorted(f"r{n}" for n in range(1, 8))
    assert {e.kind for e in services["failed"].values()} == {"invalid_request"}
    assert services["failed"]["r4"].message == "job 4 is malformed"


def test_failures_past_the_intensity_escalate() -> None:
    services: dict[str, Any] = {}
    graph = make_graph(
        pipeline(
            f'- {{name: work, use: "{FLAKY}", with: {{fail_at: [2, 4, 6]}},'
            " supervision: {max_restarts: 2, within_s: 60}}"
        ),
        services,
    )
    run(graph)
    assert graph.failure is not None and graph.failure.stage == "work"
    assert "boom at 6" in graph.failure.traceback
    assert not graph.healthy
    assert sorted(services["failed"])[:2] == ["r2", "r4"]


def test_a_restart_group_starts_over_with_fresh_state() -> None:
    services: dict[str, Any] = {}
    graph = make_graph(
        f"""
        stages:
          - {{name: jobs, use: "{JOBS}", with: {{count: 30}}}}
          - name: first
            use: "{TALLY}"
            supervision: {{on_error: restart, group: pair}}
          - name: second
            use: "{TALLY}"
            with: {{fail_at: [10]}}
            supervision: {{on_error: restart, group: pair}}
          - {{name: done, use: "{DONE}"}}
        edges:
          - jobs.out -> first.in
          - first.out -> second.in
          - second.out -> done.in
          - first.errors -> done.errors
          - second.errors -> done.errors
        """,
        services,
    )
    run(graph)
    assert graph.failure is None
    tallies = services["tallies"]
    assert len(tallies) == 4  # two built with the graph, two by the restart
    first, second = graph.stage("first"), graph.stage("second")
    assert first is tallies[2] and second is tallies[3]
    assert second.inherited == 11 and first.inherited is not None  # the kept counts
    assert "r10" in services["failed"]
    # Jobs on the channel inside the group at the restart were dropped; the rest arrived.
    completed = set(services["completed"])
    assert completed.isdisjoint({"r10"})
    assert {f"r{n}" for n in range(first.inherited, 30)} <= completed
    assert metric(graph, "flowllm:stage_restarts_total", {"group": "pair"}) == 1
    assert metric(graph, "flowllm:live_sequences", {"stage": "second"}) == second.counted[0]


def test_the_watchdog_cancels_a_stage_stuck_on_one_message() -> None:
    services: dict[str, Any] = {}
    graph = make_graph(
        pipeline(
            f'- {{name: work, use: "{FLAKY}", with: {{hang_at: [5]}},'
            " supervision: {timeout_s: 0.3}}",
            count=60,
            delay=0.02,
        ),
        services,
    )
    health: list[bool] = []

    async def main() -> None:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await tg.start(graph.run)
                while not graph.finished:
                    health.append(graph.healthy)
                    await anyio.sleep(0.01)

    anyio.run(main)
    assert graph.failure is None
    assert list(services["failed"]) == ["r5"]
    assert "StageTimeout" in services["failed"]["r5"].message
    assert sorted(services["completed"]) == sorted(set(jobs(60)) - {"r5"})
    assert False in health  # unhealthy while overdue ...
    assert health[-1] is True  # ... and healthy again once it was handled


def test_a_restart_group_overdue_restarts() -> None:
    services: dict[str, Any] = {}
    graph = make_graph(
        pipeline(
            f'- {{name: work, use: "{TALLY}", with: {{hang_at: [4]}},'
            " supervision: {on_error: restart, timeout_s: 0.2}}"
        ),
        services,
    )
    run(graph, limit=10)
    assert graph.failure is None
    assert "r4" in services["failed"]
    assert len(services["tallies"]) == 2
    assert metric(graph, "flowllm:stage_restarts_total", {"group": "work"}) == 1


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ("{on_error: retry}", "invalid supervision"),
        ("{max_restarts: -1}", "max_restarts must be >= 0"),
        ("{timeout_s: 0}", "timeout_s must be > 0"),
        ("{colour: red}", "invalid supervision"),
        ("{on_error: fail_request, group: g}", "only applies with on_error: restart"),
    ],
)
def test_bad_supervision_entries_are_reported(entry: str, problem: str) -> None:
    spec = GraphSpec.from_yaml(
        pipeline(f'- {{name: work, use: "{FLAKY}", supervision: {entry}}}'),
        source="<test>",
    )
    with pytest.raises(GraphValidationError) as info:
        validate_graph(spec)
    assert problem in str(info.value) and "stage 'work'" in str(info.value)


def test_a_group_has_one_intensity() -> None:
    spec = GraphSpec.from_yaml(
        f"""
        stages:
          - {{name: jobs, use: "{JOBS}", with: {{count: 1}}}}
          - {{name: a, use: "{TALLY}", supervision: {{on_error: restart, group: g}}}}
          - {{name: b, use: "{TALLY}",
             supervision: {{on_error: restart, group: g, max_restarts: 9}}}}
          - {{name: done, use: "{DONE}"}}
        edges: [jobs.out -> a.in, a.out -> b.in, b.out -> done.in,
                a.errors -> done.errors, b.errors -> done.errors]
        """,
        source="<test>",
    )
    with pytest.raises(GraphValidationError, match="a group has one restart intensity"):
        validate_graph(spec)


def test_graph_show_prints_each_stages_supervision() -> None:
    graph = make_graph(
        pipeline(
            f'- {{name: work, use: "{TALLY}",'
            " supervision: {on_error: restart, group: loop, timeout_s: 30}}"
        ),
        {},
        logger=quiet_logger(),
    )
    text = render_text(graph.spec)
    assert "supervision: on_error: restart, group: loop, max 5 in 60 s, timeout: 30 s" in text
    assert "supervision: on_error: fail_request, max 5 in 60 s" in text  # done's default
