"""docs/stages.md is executable: its drawings are what `flowllm graph show` prints, its
message tables list every field, and its step-by-step stage is written to a temporary
`.py` file, inserted into a copy of the default YAML and served, as a user would."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import typing
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest
from example_server import EXAMPLES, MODEL_NAME
from server_process import DEFAULT_GRAPH, REPO

import flowllm.messages as messages
from flowllm.cli import main

GUIDE = REPO / "docs" / "stages.md"
_BLOCK = re.compile(r"<!-- doctest: ([^>]+?) -->\n(```[a-z]*\n(.*?)\n```|(\|.*?)\n\n)", re.S)


def guide_blocks() -> list[tuple[str, str]]:
    """(name, body) of every block marked `<!-- doctest: name -->`, in order."""
    return [(m.group(1), m.group(3) or m.group(4)) for m in _BLOCK.finditer(GUIDE.read_text())]


def block(name: str) -> str:
    (found,) = [body for n, body in guide_blocks() if n == name]
    return found


def flowllm(*args: str, cwd: Path | None = None) -> tuple[int, str, str]:
    """`flowllm ARGS` run in `cwd` through the CLI's own entry point, in this process (one
    import of flowllm for every command): (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    previous = Path.cwd()
    os.chdir(cwd or REPO)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main(list(args))
    finally:
        os.chdir(previous)
    return status, out.getvalue(), err.getvalue()


def run_commands(body: str, cwd: Path, rename: tuple[str, str] | None = None) -> list[str]:
    """Run a `commands` block's lines in `cwd`, with `rename` = (old, new) replaced in each:
    `flowllm graph ...` through the CLI, anything else through bash. The `flowllm serve`
    lines are returned, for the caller to start as a real server."""
    serve_lines = []
    for line in body.splitlines():
        command = line.split("  #")[0].strip()
        if rename is not None:
            command = command.replace(*rename)
        if not command:
            continue
        if command.startswith("flowllm serve"):
            serve_lines.append(command)
        elif command.startswith("flowllm "):
            status, out, err = flowllm(*shlex.split(command)[1:], cwd=cwd)
            assert status == 0, f"{command!r} failed:\n{out}\n{err}"
        else:
            done = subprocess.run(
                ["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=60
            )
            assert done.returncode == 0, f"{command!r} failed:\n{done.stdout}\n{done.stderr}"
    return serve_lines


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A user's folder, with the checkout's examples at the relative path the guide uses."""
    (tmp_path / "examples").symlink_to(EXAMPLES)
    return tmp_path


def test_graph_drawings_are_what_graph_show_prints() -> None:
    status, shown, err = flowllm("graph", "show")
    assert status == 0, err
    text, _, _ = shown.partition("\nflowchart LR")
    text = text.rstrip("\n").replace(str(DEFAULT_GRAPH), "flowllm/engine/default.yaml")
    assert block("show-text") == text
    assert block("show-mermaid") == flowllm("graph", "show", "--mermaid")[1].rstrip("\n")


def test_the_anatomy_snippet_is_schedules_own_declaration() -> None:
    source = (REPO / "flowllm" / "stages" / "schedule.py").read_text()
    for line in block("anatomy").splitlines():
        code = line.split("  #")[0].strip()
        if code and code != "...":
            assert code in source, code


def test_the_supervision_snippet_is_the_default_graphs_own() -> None:
    source = DEFAULT_GRAPH.read_text()
    for line in block("supervision").splitlines():
        assert line in source, line


def _type_text(tp: Any) -> str:
    text = tp.__name__ if isinstance(tp, type) else str(tp)
    text = text.replace("typing.", "").replace("flowllm.messages.", "")
    text = text.replace("Optional[Literal['stop', 'length', 'abort']]", "FinishReason | None")
    text = text.replace("Literal['stop', 'length', 'abort']", "FinishReason")
    return text.replace(str(messages.ErrorKind).replace("typing.", ""), "ErrorKind")


def test_message_tables_list_every_field_with_its_type() -> None:
    tables = {n.split()[1]: body for n, body in guide_blocks() if n.startswith("fields ")}
    for name, body in tables.items():
        cls = getattr(messages, name)
        hints = typing.get_type_hints(cls)
        rows = [line.split(" | ") for line in body.splitlines()[2:]]
        documented = [(r[0].strip("| `"), r[1].strip("`").replace("\\|", "|")) for r in rows]
        actual = [(f.name, _type_text(hints[f.name])) for f in msgspec.structs.fields(cls)]
        assert documented == actual, name
    # every type on an edge of the built-in graphs (and the structs inside them) has a table
    on_edges = {
        "GenerateRequest", "ValidRequest", "TokenizedRequest", "Abort", "RequestError",
        "StepBatch", "ScheduledRows", "ScheduledSeq", "SeqStart", "StepMasks", "StepLogits",
        "StepTokens", "SampledTokens", "SampledToken", "ChoiceEvents", "ChoiceStart",
        "TokenLogprobs", "Finish", "TextDeltas", "Chunk", "StepHidden", "SampledIds",
    }  # fmt: skip
    assert set(tables) == on_edges


def _write_stage_file(workdir: Path) -> None:
    (workdir / "blocklist.py").write_text(block("blocklist.py") + "\n")


def _edit_graph(text: str) -> str:
    """The guide's step 2: the stage line after validate's, the edge split in three."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if "{name: tokenize," in line)
    lines.insert(at, block("my-graph-stage"))  # after validate's entry
    at = next(i for i, line in enumerate(lines) if "{from: validate.out, to: tokenize.in" in line)
    lines[at : at + 1] = block("my-graph-edges").splitlines()
    return "\n".join(lines) + "\n"


def test_the_guides_new_stage_is_served(workdir: Path, start_server: Any) -> None:
    blocks = [body for name, body in guide_blocks() if name == "commands"]
    _write_stage_file(workdir)
    graph = workdir / "my-graph.yaml"
    # Step 2 runs in the checkout (where flowllm/engine/default.yaml is) but writes here.
    run_commands(blocks[0], REPO, rename=("my-graph.yaml", str(graph)))
    graph.write_text(_edit_graph(graph.read_text()))
    assert run_commands(blocks[1], workdir) == ["flowllm serve MODEL --graph my-graph.yaml"]
    shown = flowllm("graph", "show", str(graph))[1]
    assert "blocklist.py:Blocklist" in shown
    # fan-in: the new errors port joins the one deliver.errors channel
    (errors_channel,) = [line for line in shown.splitlines() if "-> deliver.errors" in line]
    assert "blocklist.errors" in errors_channel and "validate.errors" in errors_channel

    server = start_server(graph, cwd=workdir)
    client = server.client()
    ok = client.completions.create(model=MODEL_NAME, prompt="An apple", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL_NAME, prompt="Tell me of the Forbidden Fruit", max_tokens=3
        )
    assert info.value.status_code == 400
    assert "The prompt contains a blocked phrase." in str(info.value)
    assert info.value.code == "blocked_phrase"
    with pytest.raises(openai.BadRequestError):  # streaming is refused the same way
        list(
            client.completions.create(
                model=MODEL_NAME, prompt="forbidden fruit", max_tokens=3, stream=True
            )
        )
    again = client.completions.create(
        model=MODEL_NAME, prompt="An apple", max_tokens=3, temperature=0
    )
    assert again.usage.completion_tokens == 3


def test_the_guides_validation_messages(workdir: Path) -> None:
    _write_stage_file(workdir)
    base = _edit_graph(DEFAULT_GRAPH.read_text())
    stage_line = block("my-graph-stage")
    variants = [
        base.replace("to: tokenize.in,", "to: tokenize.inn,"),
        base.replace("{from: detokenize.out, to: deliver.in", "{from: sample.out, to: deliver.in"),
        base.replace("with: {phrases: [forbidden fruit]}", "with: {}"),
        base.replace("with: {phrases: [forbidden fruit]}", "with: {phrase: [x]}"),
        base.replace("blocklist.py:Blocklist", "blocklist.py:BlockList"),
        base.replace("  - {from: validate.out, to: blocklist.in, capacity: 256}\n", ""),
        base.replace(
            "to: detokenize.choices, capacity: 64}", "to: detokenize.choices, capacity: 9}"
        ),
    ]
    assert stage_line in base and all(v != base for v in variants)
    reported = []
    for i, text in enumerate(variants):
        path = workdir / f"broken-{i}.yaml"
        path.write_text(text)
        status, _, err = flowllm("graph", "validate", path.name, cwd=workdir)
        assert status == 1
        reported.append(err)
    # a mistyped port is one problem, not also "tokenize.in is not connected"
    assert reported[0].startswith("1 problem in the graph:"), reported[0]
    for line, output in zip(block("problems").splitlines(), reported, strict=True):
        assert line in output, f"{line!r} not in:\n{output}"


def test_the_guides_example_commands(workdir: Path) -> None:
    blocks = [body for name, body in guide_blocks() if name == "commands"]
    serve = run_commands(blocks[2], workdir)
    assert serve == ["flowllm serve MODEL --graph examples/graphs/redact.yaml"]
    listed = set(re.findall(r"examples/graphs/([\w-]+\.yaml)", blocks[2]))
    assert listed == {p.name for p in (EXAMPLES / "graphs").glob("*.yaml")}
