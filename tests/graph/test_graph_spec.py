"""Graph YAML validation: every broken fixture yields messages naming the culprit."""

from __future__ import annotations

from pathlib import Path

import pytest
from graph_toys import Collect, Count, Item, Loop

from flowllm.graph.problems import GraphValidationError
from flowllm.graph.spec import DEFAULT_CAPACITY, GraphSpec, PortRef
from flowllm.graph.validator import load_graph, validate_graph

FIXTURES = Path(__file__).parent / "fixtures"


def problems_of(name: str) -> list[str]:
    with pytest.raises(GraphValidationError) as info:
        load_graph(FIXTURES / name)
    return [str(p) for p in info.value.problems]


def problems_in(text: str) -> list[str]:
    with pytest.raises(GraphValidationError) as info:
        validate_graph(GraphSpec.from_yaml(text, source="g.yaml", base_dir=FIXTURES))
    return [str(p) for p in info.value.problems]


def test_a_valid_graph_resolves_classes_params_and_channels() -> None:
    graph = load_graph(FIXTURES / "pipeline.yaml")
    assert graph.name == "pipeline"
    assert list(graph.stages) == ["source", "relay", "sink"]
    assert graph.stages["source"].cls is Count
    assert graph.stages["source"].params == Count.Params(count=100)
    assert graph.stages["sink"].cls is Collect
    assert graph.channels["relay.in"].capacity == DEFAULT_CAPACITY
    assert graph.channels["sink.in"].capacity == 8
    assert graph.channels["sink.in"].message_type is Item
    assert graph.fanout[PortRef("relay", "out")] == ("sink.in",)


def test_malformed_yaml_names_its_line() -> None:
    (problem,) = problems_of("malformed.yaml")
    assert "malformed.yaml:5: malformed YAML" in problem
    assert "line 4" in problem  # where the unclosed mapping began


def test_duplicate_stage_names() -> None:
    (problem,) = problems_of("duplicate_stage.yaml")
    assert "duplicate_stage.yaml:4: stage 'sink' is defined twice (first at line 3)" in problem


def test_unknown_import_paths() -> None:
    problems = problems_of("unknown_import.yaml")
    assert len(problems) == 2
    assert "stage 'relay': cannot import 'graph_toys_missing.stages'" in problems[0]
    assert "no module named 'graph_toys_missing'" in problems[0]
    assert "stage 'relay2': 'graph_toys' has no attribute 'Rellay'" in problems[1]
    assert "(did you mean 'Relay'?)" in problems[1]


def test_a_class_that_is_not_a_stage() -> None:
    problems = problems_of("not_a_stage.yaml")
    assert "stage 'thing': 'graph_toys:NotAStage' is a class NotAStage, not a Stage" in problems[0]
    assert "stage 'message': 'graph_toys:Item' is a class Item, not a Stage" in problems[1]


def test_bad_params_unknown_wrong_type_and_missing() -> None:
    problems = problems_of("bad_params.yaml")
    assert len(problems) == 3
    assert "stage 'source' (Count): unknown param 'cuont' (did you mean 'count'?)" in problems[0]
    assert "known params: count, origin" in problems[0]
    assert "stage 'source' (Count): missing required param 'count' (int)" in problems[1]
    assert "stage 'relay' (Relay): param 'delay' must be float, got 'slow' (str)" in problems[2]


def test_unknown_ports_suggest_the_nearest_name() -> None:
    joined = "\n".join(problems_of("unknown_port.yaml"))
    assert (
        "unknown_port.yaml:6: edge 'source.out -> relay.inn': stage 'relay' (Relay) has no "
        "input port 'inn' (did you mean 'in'?); its input ports: in" in joined
    )
    assert "unknown_port.yaml:7: edge 'relay.otu -> sink.in': stage 'relay' (Relay) has no " in (
        joined
    )
    assert "output port 'otu' (did you mean 'out'?)" in joined
    assert "unknown_port.yaml:8: edge 'source.out -> sinc.in': unknown stage 'sinc' " in joined
    assert "(did you mean 'sink'?)" in joined


def test_an_edge_written_backwards_says_so() -> None:
    problems = problems_in(
        """
        stages:
          - {name: source, use: "graph_toys:Count", with: {count: 1}}
          - {name: sink, use: "graph_toys:Collect"}
        edges:
          - sink.in -> source.out
        """
    )
    joined = "\n".join(problems)
    assert "sink.in is an input port, and edges go from an output port to an input port" in joined
    assert "source.out is an output port" in joined


def test_unconnected_ports() -> None:
    problems = problems_of("unconnected.yaml")
    assert problems == [
        f"{FIXTURES / 'unconnected.yaml'}:3: stage 'relay': output port 'out' (Item) is not "
        "connected; add an edge from relay.out",
        f"{FIXTURES / 'unconnected.yaml'}:4: stage 'sink': input port 'in' (Item) is not "
        "connected; add an edge into sink.in",
    ]


def test_type_mismatch_names_both_types_and_the_edge() -> None:
    (problem,) = problems_of("type_mismatch.yaml")  # MixedOut -> Sink(Any) is fine
    assert (
        "edge 'texts.out -> sink.in': type mismatch: texts.out sends Other but sink.in "
        "accepts Item (Other not accepted)" in problem
    )


def test_a_union_producer_needs_every_member_accepted() -> None:
    problems = problems_in(
        """
        stages:
          - {name: mixed, use: "graph_toys:MixedOut"}
          - {name: sink, use: "graph_toys:Collect"}
        edges:
          - mixed.out -> sink.in
        """
    )
    assert (
        "mixed.out sends Item | Other but sink.in accepts Item (Other not accepted)"
        in (problems[0])
    )


def test_a_cycle_without_a_credit_bound_is_refused() -> None:
    (problem,) = problems_of("cycle_unbounded.yaml")
    assert "cycle merge -> relay -> merge is not credit-bounded" in problem


def test_a_cycle_channel_below_the_credit_bound_is_refused() -> None:
    (problem,) = problems_of("cycle_capacity.yaml")
    assert "cycle loop -> execute -> sample -> loop" in problem
    assert "channel 'execute.in' has capacity 2, below the credit bound 4 of stage 'loop'" in (
        problem
    )
    assert "(max_inflight_steps)" in problem


def test_a_credit_bounded_cycle_is_accepted() -> None:
    graph = load_graph(FIXTURES / "cycle_ok.yaml")
    assert graph.stages["loop"].cls is Loop
    assert graph.stages["loop"].credit_bound == 2


PER_STEP = (FIXTURES / "cycle_per_step.yaml").read_text()


def test_a_per_step_channel_needs_its_consumers_loop_intake_plus_the_credit_bound_plus_one() -> (
    None
):
    graph = load_graph(FIXTURES / "cycle_per_step.yaml")  # notes.notes: 3 + 2 + 1
    assert graph.channels["notes.notes"].capacity == 6
    (problem,) = problems_in(
        PER_STEP.replace("notes.notes, capacity: 6", "notes.notes, capacity: 5")
    )
    assert problem == (
        "g.yaml:15: cycle loop -> notes -> loop: channel 'notes.notes' has capacity 5, below "
        "the 6 it needs: loop.notes sends up to one message per step, and stage 'loop' stops "
        "starting steps only once 'notes.in' is full; give it capacity >= 6 (capacity 3 of "
        "'notes.in' + the credit bound 2 of stage 'loop' (max_inflight_steps) + 1)"
    )
    (problem,) = problems_in(PER_STEP.replace("notes.in, capacity: 3", "notes.in, capacity: 4"))
    assert "channel 'notes.notes' has capacity 6, below the 7 it needs" in problem
    replicated = PER_STEP.replace("max_inflight_steps: 2}}", "max_inflight_steps: 2}, replicas: 2}")
    problems = problems_in(replicated)
    assert any(
        "channel 'notes.notes' has capacity 6, below the 8 it needs" in p
        and "credit bound 4 of stage 'loop' (max_inflight_steps x 2 replicas) + 1)" in p
        for p in problems
    ), problems


def test_a_per_step_channel_off_every_cycle_needs_only_room_for_one() -> None:
    text = PER_STEP.replace("notes.notes, capacity: 6", "notes.notes, capacity: 1")
    assert problems_in(text)  # on the cycle through loop.finishes
    graph = validate_graph(
        GraphSpec.from_yaml(
            text.replace("to: loop.finishes", "to: sink.in"), source="g.yaml", base_dir=FIXTURES
        )
    )
    assert graph.channels["notes.notes"].capacity == 1


def test_a_per_step_channel_whose_consumer_takes_no_steps_from_the_loop_is_refused() -> None:
    text = PER_STEP.replace(
        "  - {from: sample.out, to: notes.in, capacity: 3}\n",
        "  - {from: sample.out, to: relay.in, capacity: 3}\n"
        "  - {from: relay.out, to: notes.in, capacity: 3}\n",
    ).replace(
        "  - {name: notes,", '  - {name: relay, use: "graph_toys:StepRelay"}\n  - {name: notes,'
    )
    (problem,) = problems_in(text)
    assert problem == (
        "g.yaml:17: cycle loop -> notes -> loop: channel 'notes.notes' is not bounded: "
        "loop.notes sends up to one message per step of stage 'loop', but no input of stage "
        "'notes' is fed by that stage's credited loop, so the steps do not stop while 'notes' "
        "waits; feed 'notes' from the loop or break the cycle"
    )


def test_per_step_outputs_must_name_output_ports_of_a_credit_bounded_stage() -> None:
    problems = problems_in(
        """
        stages:
          - {name: stray, use: "graph_toys:StrayPerStep"}
          - {name: uncredited, use: "graph_toys:UncreditedPerStep"}
        edges: []
        """
    )
    assert problems == [
        "g.yaml:3: stage 'stray': StrayPerStep.per_step_outputs names 'notse', not an output "
        "port; its output ports: notes",
        "g.yaml:4: stage 'uncredited': UncreditedPerStep.per_step_outputs needs a "
        "credit_param: only the steps a stage keeps in flight bound what it sends once a step",
    ]


def test_every_problem_is_reported_at_once_in_file_order() -> None:
    problems = problems_of("many_problems.yaml")
    expected = [
        (3, "param 'count' must be int, got '3' (str)"),
        (4, "stage 'relay': 'replicas' must be an int >= 1, got 0"),
        (5, "stage 'sink': unknown key 'wiht' (did you mean 'with'?)"),
        (7, "stage 'nowhere': cannot import 'no_such_pkg'"),
        (9, "stage 'sink' (Collect) has no input port 'inn' (did you mean 'in'?)"),
        (10, "texts.out sends Other but sink.in accepts Item"),
        (12, "edge 'this is not an edge' is malformed"),
    ]
    for line, text in expected:
        assert any(f"many_problems.yaml:{line}: " in p and text in p for p in problems), text
    lines = [int(p.split(".yaml:")[1].split(":")[0]) for p in problems]
    assert lines == sorted(lines)


def test_structural_problems() -> None:
    problems = problems_in(
        """
        graph: g
        stages:
          - {name: a, use: "graph_toys:Count", with: {count: 1}, replica: 2}
          - {use: "graph_toys:Collect"}
          - {name: c, use: "graph_toys"}
          - just a string
        edges:
          - {from: a.out, to: b, capacity: 0}
          - {form: a.out, to: c.in}
        colour: blue
        """
    )
    joined = "\n".join(problems)
    assert "unknown top-level key 'colour'" in joined
    assert "stage 'a': unknown key 'replica' (did you mean 'replicas'?)" in joined
    assert "stages[1]: 'name' must be an identifier" in joined
    assert "stage 'c': use: 'graph_toys' must be 'pkg.module:Class'" in joined
    assert "stages[3] must be a mapping" in joined
    assert "edges[0]: 'to' must be 'stage.port', got 'b'" in joined
    assert "edges[0]: capacity must be an int >= 1, got 0" in joined
    assert "edges[1]: unknown key 'form' (did you mean 'from'?)" in joined


def test_missing_file_and_empty_file() -> None:
    with pytest.raises(GraphValidationError, match="cannot read graph file"):
        load_graph(FIXTURES / "does_not_exist.yaml")
    assert "a graph file must be a mapping" in problems_in("")[0]


def test_use_accepts_a_py_file_relative_to_the_yaml(tmp_path: Path) -> None:
    graph = load_graph(FIXTURES / "py_file_stage.yaml")
    # Two spellings of one file load one module, so their classes are the same.
    assert graph.stages["numbers"].cls.__module__ == graph.stages["scale"].cls.__module__
    assert graph.stages["scale"].params.factor == 3  # type: ignore[attr-defined]
    broken = tmp_path / "broken_stage.py"
    broken.write_text("def oops(:\n")
    problems = problems_in(
        f"""
        stages:
          - {{name: a, use: "{broken}:Thing"}}
          - {{name: b, use: "nope/missing.py:Thing"}}
        edges: []
        """
    )
    assert "stage 'a': cannot import" in problems[0] and "SyntaxError" in problems[0]
    assert "stage 'b': cannot import 'nope/missing.py'" in problems[1]
    assert "does not exist" in problems[1]


def test_replicas_of_the_credit_stage_multiply_its_bound() -> None:
    text = (FIXTURES / "cycle_ok.yaml").read_text()
    text = text.replace(
        "max_inflight_steps: 2, steps: 5}}", "max_inflight_steps: 2, steps: 5}, replicas: 2}"
    )
    problems = problems_in(text)
    assert len(problems) == 3  # execute.in, sample.in and loop.results hold 2 < 4
    assert (
        "channel 'execute.in' has capacity 2, below the credit bound 4 of stage 'loop'"
        in (problems[0])
    )
    assert "(max_inflight_steps x 2 replicas)" in problems[0]
    zero = (
        (FIXTURES / "cycle_ok.yaml")
        .read_text()
        .replace("max_inflight_steps: 2", "max_inflight_steps: 0")
    )
    (problem,) = problems_in(zero)
    assert "stage 'loop' has credit bound 0 (max_inflight_steps); it must be >= 1" in problem
