"""A graph file as written: its YAML read into a `GraphSpec`, every malformed entry
reported as a problem with its line (`validate_graph` in validator.py then binds and checks it).

The schema (docs/stages.md, "The graph file"):

    graph: NAME                       # optional, defaults to the file's stem
    stages:
      - name: STAGE                   # unique
        use: pkg.mod:Class            # or path/to/file.py:Class, relative to the YAML's folder
        with: {param: value}          # checked against Class.Params (a msgspec Struct)
        replicas: 2                   # optional: N tasks sharing one inbox
        supervision: {on_error: restart, group: step_loop, timeout_s: 60}  # optional
        process: core                 # optional: the process it runs in (all stages or none)
    edges:
      - a.out -> b.in                 # default capacity (64 messages)
      - {from: a.out, to: b.in, capacity: 8}

Channels. Each connected input port is one channel, named `stage.port`; several edges into
one port (fan-in) share it and its capacity is the largest they give. An output port
connected to several inputs (fan-out) sends every message to each of them.

Placement. A stage's `process:` names the operating-system process it runs in. A graph
whose stages name no process runs in one; an edge between two processes is a
cross-process channel (flowllm/graph/remote.py) with the same contract as a local one.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from flowllm.graph.problems import GraphValidationError, Problem, suggest

_Item = TypeVar("_Item")

DEFAULT_CAPACITY = 64

_NAME = r"[A-Za-z_][A-Za-z0-9_\-]*"
_PORT_REF = re.compile(rf"^\s*({_NAME})\.([A-Za-z_][A-Za-z0-9_]*)\s*$")
_EDGE = re.compile(rf"^\s*({_NAME}\.[A-Za-z_]\w*)\s*->\s*({_NAME}\.[A-Za-z_]\w*)\s*$")
_TOP_KEYS = ("graph", "stages", "edges")
_STAGE_KEYS = ("name", "use", "with", "replicas", "supervision", "process")
_EDGE_KEYS = ("from", "to", "capacity")


@dataclass(frozen=True)
class PortRef:
    stage: str
    port: str

    def __str__(self) -> str:
        return f"{self.stage}.{self.port}"


@dataclass(frozen=True)
class StageSpec:
    name: str
    use: str
    params: dict[str, Any] = field(default_factory=dict)
    replicas: int = 1
    line: int | None = None
    supervision: object = None  # the raw `supervision:` mapping, checked by the validator
    process: str | None = None  # where it runs; None: the graph's one process


@dataclass(frozen=True)
class EdgeSpec:
    src: PortRef
    dst: PortRef
    capacity: int = DEFAULT_CAPACITY
    line: int | None = None

    def __str__(self) -> str:
        return f"{self.src} -> {self.dst}"


@dataclass(frozen=True)
class GraphSpec:
    """A graph as its YAML says it; `problems` holds entries that could not be read."""

    name: str
    stages: tuple[StageSpec, ...]
    edges: tuple[EdgeSpec, ...]
    source: str = "<graph>"
    base_dir: Path = field(default_factory=Path.cwd)
    problems: tuple[Problem, ...] = ()

    @property
    def placement(self) -> dict[str, str]:
        """Every stage's process as the file names it, or {} when none names one (the
        validator checks that every stage or none does)."""
        if not any(stage.process for stage in self.stages):
            return {}
        return {stage.name: stage.process or "" for stage in self.stages}

    @classmethod
    def load(cls, path: str | Path) -> GraphSpec:
        """Read a graph file; raises GraphValidationError if it is not readable YAML."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise GraphValidationError(
                [Problem(f"cannot read graph file: {exc.strerror or exc}", None, str(path))]
            ) from None
        return cls.from_yaml(text, source=str(path), base_dir=path.resolve().parent)

    @classmethod
    def from_yaml(
        cls, text: str, *, source: str = "<graph>", base_dir: Path | None = None
    ) -> GraphSpec:
        """Parse YAML text; `base_dir` anchors relative `.py` paths in `use:`."""
        base = base_dir if base_dir is not None else Path.cwd()
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
            data = loader.construct_document(node) if node is not None else None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
            line = mark.line + 1 if mark is not None else None
            what = getattr(exc, "problem", None) or str(exc)
            context = getattr(exc, "context", None)
            context_mark = getattr(exc, "context_mark", None)
            if context and context_mark is not None:
                what = f"{context} (from line {context_mark.line + 1}): {what}"
            raise GraphValidationError([Problem(f"malformed YAML: {what}", line, source)]) from None
        finally:
            loader.dispose()
        return _Reader(source, base).read(data, node)


class _Reader:
    """Turns parsed YAML (and its node tree, for line numbers) into a GraphSpec."""

    def __init__(self, source: str, base_dir: Path) -> None:
        self.source = source
        self.base_dir = base_dir
        self.problems: list[Problem] = []

    def problem(self, message: str, line: int | None) -> None:
        self.problems.append(Problem(message, line, self.source))

    def read(self, data: object, node: yaml.Node | None) -> GraphSpec:
        default_name = Path(self.source).stem if self.source != "<graph>" else "graph"
        if not isinstance(data, dict):
            self.problem("a graph file must be a mapping with 'stages' and 'edges'", _line(node))
            return self.spec(default_name, [], [])
        for key in data:
            if key not in _TOP_KEYS:
                self.problem(
                    f"unknown top-level key {key!r}{suggest(str(key), _TOP_KEYS)}; "
                    f"expected {', '.join(_TOP_KEYS)}",
                    _line(_child(node, key)),
                )
        name = data.get("graph", default_name)
        if not isinstance(name, str):
            self.problem("'graph' (the graph's name) must be a string", _line(node))
            name = default_name
        stages = self.read_list(data, node, "stages", self.read_stage)
        edges = self.read_list(data, node, "edges", self.read_edge)
        return self.spec(name, stages, edges)

    def spec(self, name: str, stages: list[StageSpec], edges: list[EdgeSpec]) -> GraphSpec:
        return GraphSpec(
            name, tuple(stages), tuple(edges), self.source, self.base_dir, tuple(self.problems)
        )

    def read_list(
        self,
        data: dict[str, Any],
        node: yaml.Node | None,
        key: str,
        read_item: Callable[[object, yaml.Node | None, int], _Item | None],
    ) -> list[_Item]:
        items = data.get(key)
        items_node = _child(node, key)
        if items is None:
            self.problem(f"the graph has no '{key}' list", _line(items_node or node))
            return []
        if not isinstance(items, list):
            self.problem(f"'{key}' must be a list", _line(items_node))
            return []
        out = []
        nodes = items_node.value if isinstance(items_node, yaml.SequenceNode) else []
        for index, item in enumerate(items):
            item_node = nodes[index] if index < len(nodes) else None
            parsed = read_item(item, item_node, index)
            if parsed is not None:
                out.append(parsed)
        return out

    def read_stage(self, item: object, node: yaml.Node | None, index: int) -> StageSpec | None:
        line = _line(node)
        if not isinstance(item, dict):
            self.problem(f"stages[{index}] must be a mapping with 'name' and 'use'", line)
            return None
        name = item.get("name")
        label = f"stage {name!r}" if isinstance(name, str) else f"stages[{index}]"
        for key in item:
            if key not in _STAGE_KEYS:
                self.problem(
                    f"{label}: unknown key {key!r}{suggest(str(key), _STAGE_KEYS)}; "
                    f"expected {', '.join(_STAGE_KEYS)}",
                    _line(_child(node, key)) or line,
                )
        if not isinstance(name, str) or not re.fullmatch(_NAME, name):
            self.problem(
                f"{label}: 'name' must be an identifier (letters, digits, _ or -), got {name!r}",
                line,
            )
            name = None
        use = item.get("use")
        use = use.strip() if isinstance(use, str) else ""
        if not use:
            self.problem(f"{label}: 'use' must be 'pkg.module:Class' or 'file.py:Class'", line)
        if name is None or not use:
            return None
        # Past this point the stage is kept (so edges naming it are checked) even when
        # `with` or `replicas` is wrong; the problem alone makes the graph invalid.
        params = item.get("with", {})
        if params is None:
            params = {}
        if not isinstance(params, dict):
            self.problem(f"{label}: 'with' must be a mapping of params", line)
            params = {}
        replicas = item.get("replicas", 1)
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            self.problem(f"{label}: 'replicas' must be an int >= 1, got {replicas!r}", line)
            replicas = 1
        process = item.get("process")
        if process is not None and (
            not isinstance(process, str) or not re.fullmatch(_NAME, process)
        ):
            self.problem(
                f"{label}: 'process' must be a process name (letters, digits, _ or -), "
                f"got {process!r}",
                line,
            )
            process = None
        return StageSpec(name, use, dict(params), replicas, line, item.get("supervision"), process)

    def read_edge(self, item: object, node: yaml.Node | None, index: int) -> EdgeSpec | None:
        line = _line(node)
        capacity: object = DEFAULT_CAPACITY
        if isinstance(item, str):
            match = _EDGE.match(item)
            if match is None:
                self.problem(
                    f"edge {item!r} is malformed; write 'stage.port -> stage.port' or "
                    "{from: stage.port, to: stage.port, capacity: N}",
                    line,
                )
                return None
            src_text, dst_text = match.group(1), match.group(2)
        elif isinstance(item, dict):
            for key in item:
                if key not in _EDGE_KEYS:
                    self.problem(
                        f"edges[{index}]: unknown key {key!r}{suggest(str(key), _EDGE_KEYS)}; "
                        f"expected {', '.join(_EDGE_KEYS)}",
                        line,
                    )
            src_text, dst_text = item.get("from"), item.get("to")
            capacity = item.get("capacity", DEFAULT_CAPACITY)
        else:
            self.problem(f"edges[{index}] must be 'a.out -> b.in' or a mapping", line)
            return None
        refs = []
        for role, text in (("from", src_text), ("to", dst_text)):
            match = _PORT_REF.match(text) if isinstance(text, str) else None
            if match is None:
                self.problem(f"edges[{index}]: '{role}' must be 'stage.port', got {text!r}", line)
            else:
                refs.append(PortRef(match.group(1), match.group(2)))
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            self.problem(f"edges[{index}]: capacity must be an int >= 1, got {capacity!r}", line)
            return None
        if len(refs) != 2:
            return None
        return EdgeSpec(refs[0], refs[1], capacity, line)


def _line(node: yaml.Node | None) -> int | None:
    return node.start_mark.line + 1 if isinstance(node, yaml.Node) else None


def _child(node: yaml.Node | None, key: str) -> yaml.Node | None:
    """The value node under `key` in a mapping node (None if absent)."""
    if not isinstance(node, yaml.MappingNode):
        return None
    for key_node, value_node in node.value:
        if isinstance(key_node, yaml.ScalarNode) and key_node.value == key:
            return value_node
    return None
