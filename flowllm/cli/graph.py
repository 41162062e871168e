"""`flowllm graph validate FILE` and `flowllm graph show [FILE]`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from flowllm.engine.async_engine import DEFAULT_GRAPH
from flowllm.graph.problems import GraphValidationError
from flowllm.graph.render import render_mermaid, render_text
from flowllm.graph.spec import GraphSpec
from flowllm.graph.validator import ValidGraph, validate_graph


def validate_command(path: str | Path, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Exit status 0 for a valid graph; otherwise print every problem and return 1."""
    out = out or sys.stdout
    err = err or sys.stderr
    graph = _load(path, err)
    if graph is None:
        return 1
    print(
        f"{path}: graph {graph.name!r} is valid: {len(graph.stages)} stages, "
        f"{len(graph.spec.edges)} edges, {len(graph.channels)} channels",
        file=out,
    )
    return 0


def show_command(
    path: str | Path | None,
    mermaid_only: bool = False,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Print a graph as a text listing and a Mermaid flowchart (the built-in one by default)."""
    out = out or sys.stdout
    err = err or sys.stderr
    graph = _load(DEFAULT_GRAPH if path is None else path, err)
    if graph is None:
        return 1
    if not mermaid_only:
        print(render_text(graph), file=out)
        print(file=out)
    print(render_mermaid(graph), file=out)
    return 0


def _load(path: str | Path, err: TextIO) -> ValidGraph | None:
    try:
        return validate_graph(GraphSpec.load(path))
    except GraphValidationError as exc:
        print(exc, file=err)
        return None
