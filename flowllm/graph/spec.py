"""Graph YAML -> `GraphSpec` -> `ValidGraph`, reporting every problem at once.

The schema (docs/stages.md, "The graph file"):

    graph: NAME                       # optional, defaults to the file's stem
    stages:
      - name: STAGE                   # unique
        use: pkg.mod:Class            # or path/to/file.py:Class, relative to the YAML's folder
        with: {param: value}          # checked against Class.Params (a msgspec Struct)
        replicas: 2                   # optional: N tasks sharing one inbox
        supervision: {on_error: restart, group: step_loop, timeout_s: 60}  # optional
    edges:
      - a.out -> b.in                 # default capacity (64 messages)
      - {from: a.out, to: b.in, capacity: 8}

Channels. Each connected input port is one channel, named `stage.port`; several edges into
one port (fan-in) share it and its capacity is the largest they give. An output port
connected to several inputs (fan-out) sends every message to each of them.

Validation reports every problem in one pass, each naming the stage, port and types
involved: malformed YAML (with its line), malformed entries, duplicate stage names,
unknown import paths, classes that are not Stages, bad `with:` params (unknown key, wrong
type, missing required param), unknown ports (with the nearest port name), unconnected
ports, edges whose producer type the consumer does not accept, and cycles that are not
credit-bounded.

The credit rule (docs/stages.md). A cycle of bounded channels can deadlock: every stage on it
may block sending into a full channel whose consumer is itself blocked sending. A cycle is
accepted only when some stage on it declares a credit bound B (`Stage.credit_param`, e.g.
`schedule`'s `max_inflight_steps`: it never has more than B messages in flight around the
loop; with `replicas: N` the bound is N x B) and every channel on the cycle has capacity
>= B, so no send on the cycle can block.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import re
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import yaml

from flowllm.graph.channel import type_members, type_name
from flowllm.graph.stage import Stage
from flowllm.graph.supervision import SupervisionPlan, parse_supervision, plan_groups

DEFAULT_CAPACITY = 64
MAX_CYCLES_CHECKED = 10_000

_NAME = r"[A-Za-z_][A-Za-z0-9_\-]*"
_PORT_REF = re.compile(rf"^\s*({_NAME})\.([A-Za-z_][A-Za-z0-9_]*)\s*$")
_EDGE = re.compile(rf"^\s*({_NAME}\.[A-Za-z_]\w*)\s*->\s*({_NAME}\.[A-Za-z_]\w*)\s*$")
_TOP_KEYS = ("graph", "stages", "edges")
_STAGE_KEYS = ("name", "use", "with", "replicas", "supervision")
_EDGE_KEYS = ("from", "to", "capacity")


# ---------------------------------------------------------------------------------------
# Problems


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a graph file, located by line when known."""

    message: str
    line: int | None = None
    source: str = "<graph>"

    def __str__(self) -> str:
        where = f"{self.source}:{self.line}" if self.line is not None else self.source
        return f"{where}: {self.message}"


class GraphValidationError(ValueError):
    """A graph file has problems; `problems` lists every one of them."""

    def __init__(self, problems: list[Problem] | tuple[Problem, ...]) -> None:
        self.problems = tuple(problems)
        count = len(self.problems)
        header = f"{count} problem{'s' if count != 1 else ''} in the graph:"
        super().__init__("\n".join([header, *(f"  {p}" for p in self.problems)]))


def _suggest(word: str, choices: list[str] | tuple[str, ...]) -> str:
    """' (did you mean 'x'?)' for the nearest choice, or ''."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _known(choices: list[str] | tuple[str, ...] | Any) -> str:
    names = sorted(choices)
    return ", ".join(names) if names else "none"


# ---------------------------------------------------------------------------------------
# The spec as written


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
    supervision: Any = None  # the raw `supervision:` mapping, checked by the validator


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

    def validate(self) -> ValidGraph:
        """Resolve classes and params and check the wiring; raises with every problem."""
        return _Validator(self).validate()


def load_graph(path: str | Path) -> ValidGraph:
    """Load and validate a graph file in one step."""
    return GraphSpec.load(path).validate()


class _Reader:
    """Turns parsed YAML (and its node tree, for line numbers) into a GraphSpec."""

    def __init__(self, source: str, base_dir: Path) -> None:
        self.source = source
        self.base_dir = base_dir
        self.problems: list[Problem] = []

    def problem(self, message: str, line: int | None) -> None:
        self.problems.append(Problem(message, line, self.source))

    def read(self, data: Any, node: yaml.Node | None) -> GraphSpec:
        default_name = Path(self.source).stem if self.source != "<graph>" else "graph"
        if not isinstance(data, dict):
            self.problem("a graph file must be a mapping with 'stages' and 'edges'", _line(node))
            return self.spec(default_name, [], [])
        for key in data:
            if key not in _TOP_KEYS:
                self.problem(
                    f"unknown top-level key {key!r}{_suggest(str(key), _TOP_KEYS)}; "
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

    def read_list(self, data: dict[str, Any], node: Any, key: str, read_item: Any) -> list[Any]:
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

    def read_stage(self, item: Any, node: Any, index: int) -> StageSpec | None:
        line = _line(node)
        if not isinstance(item, dict):
            self.problem(f"stages[{index}] must be a mapping with 'name' and 'use'", line)
            return None
        name = item.get("name")
        label = f"stage {name!r}" if isinstance(name, str) else f"stages[{index}]"
        ok = True
        for key in item:
            if key not in _STAGE_KEYS:
                self.problem(
                    f"{label}: unknown key {key!r}{_suggest(str(key), _STAGE_KEYS)}; "
                    f"expected {', '.join(_STAGE_KEYS)}",
                    _line(_child(node, key)) or line,
                )
        if not isinstance(name, str) or not re.fullmatch(_NAME, name):
            self.problem(
                f"{label}: 'name' must be an identifier (letters, digits, _ or -), got {name!r}",
                line,
            )
            ok = False
        use = item.get("use")
        if not isinstance(use, str) or not use.strip():
            self.problem(f"{label}: 'use' must be 'pkg.module:Class' or 'file.py:Class'", line)
            ok = False
        if not ok:
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
        return StageSpec(name, use.strip(), dict(params), replicas, line, item.get("supervision"))

    def read_edge(self, item: Any, node: Any, index: int) -> EdgeSpec | None:
        line = _line(node)
        capacity: Any = DEFAULT_CAPACITY
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
                        f"edges[{index}]: unknown key {key!r}{_suggest(str(key), _EDGE_KEYS)}; "
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


def _line(node: Any) -> int | None:
    return node.start_mark.line + 1 if isinstance(node, yaml.Node) else None


def _child(node: Any, key: str) -> Any:
    """The value node under `key` in a mapping node (None if absent)."""
    if not isinstance(node, yaml.MappingNode):
        return None
    for key_node, value_node in node.value:
        if isinstance(key_node, yaml.ScalarNode) and key_node.value == key:
            return value_node
    return None


# ---------------------------------------------------------------------------------------
# The validated graph


@dataclass(frozen=True)
class BoundStage:
    """A stage spec with its class and built params."""

    spec: StageSpec
    cls: type[Stage]
    params: msgspec.Struct
    supervision: SupervisionPlan

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def credit_bound(self) -> int | None:
        """Messages in flight around a cycle through this stage, over all its replicas."""
        bound = self.cls.credit_bound(self.params)
        return None if bound is None else bound * self.spec.replicas


@dataclass(frozen=True)
class ChannelSpec:
    """One input port's channel: its type is the consumer port's declared type."""

    name: str
    dst: PortRef
    message_type: Any
    capacity: int
    producers: tuple[PortRef, ...]


@dataclass(frozen=True)
class ValidGraph:
    """A graph that passed validation: what the runtime builds."""

    spec: GraphSpec
    stages: dict[str, BoundStage]
    channels: dict[str, ChannelSpec]  # by input port "stage.port"
    fanout: dict[PortRef, tuple[str, ...]]  # output port -> the channels it feeds

    @property
    def name(self) -> str:
        return self.spec.name


class _Validator:
    def __init__(self, spec: GraphSpec) -> None:
        self.spec = spec
        self.problems: list[Problem] = list(spec.problems)

    def problem(self, message: str, line: int | None) -> None:
        self.problems.append(Problem(message, line, self.spec.source))

    def validate(self) -> ValidGraph:
        stages = self.check_stages()
        edges = self.check_edges(stages)
        self.check_unconnected(stages, edges)
        channels, fanout = self.build_channels(stages, edges)
        self.check_cycles(stages, edges, channels)
        if self.problems:
            # In file order; problems without a line (file-level) first. sorted() is stable.
            raise GraphValidationError(sorted(self.problems, key=lambda p: p.line or 0))
        return ValidGraph(self.spec, stages, channels, fanout)

    # -- stages ---------------------------------------------------------------------------

    def check_stages(self) -> dict[str, BoundStage]:
        resolved: dict[str, tuple[StageSpec, type[Stage], msgspec.Struct, Any]] = {}
        first_line: dict[str, int | None] = {}
        for stage in self.spec.stages:
            if stage.name in first_line:
                self.problem(
                    f"stage {stage.name!r} is defined twice "
                    f"(first at line {first_line[stage.name]})",
                    stage.line,
                )
                continue
            first_line[stage.name] = stage.line
            cls = self.resolve(stage)
            if cls is None or not self.check_ports(stage, cls):
                continue
            params = self.check_params(stage, cls)
            try:
                supervision = parse_supervision(stage.supervision)
            except ValueError as exc:
                self.problem(f"stage {stage.name!r}: invalid supervision: {exc}", stage.line)
                continue
            if params is not None:
                resolved[stage.name] = (stage, cls, params, supervision)
        self.known_names = list(first_line)
        plans, problems = plan_groups(
            {name: (sup, cls.on_error) for name, (_, cls, _, sup) in resolved.items()}
        )
        for name, message in problems:
            self.problem(f"stage {name!r}: supervision: {message}", resolved[name][0].line)
        return {
            name: BoundStage(stage, cls, params, plans[name])
            for name, (stage, cls, params, _) in resolved.items()
        }

    def resolve(self, stage: StageSpec) -> type[Stage] | None:
        module_part, sep, attr = stage.use.rpartition(":")
        where = f"stage {stage.name!r}"
        if not sep or not module_part or not attr:
            self.problem(
                f"{where}: use: {stage.use!r} must be 'pkg.module:Class' or 'path/file.py:Class'",
                stage.line,
            )
            return None
        try:
            module = self.import_module(module_part)
        except _ImportProblem as exc:
            self.problem(f"{where}: cannot import {module_part!r}: {exc}", stage.line)
            return None
        obj = getattr(module, attr, None)
        if obj is None:
            names = [n for n, v in vars(module).items() if isinstance(v, type)]
            self.problem(
                f"{where}: {module_part!r} has no attribute {attr!r}{_suggest(attr, names)}",
                stage.line,
            )
            return None
        if not (isinstance(obj, type) and issubclass(obj, Stage)):
            what = f"class {obj.__name__}" if isinstance(obj, type) else type(obj).__name__
            self.problem(
                f"{where}: {stage.use!r} is a {what}, not a Stage "
                "(subclass flowllm.graph.stage.Stage)",
                stage.line,
            )
            return None
        return obj

    def import_module(self, module_part: str) -> ModuleType:
        if module_part.endswith(".py") or "/" in module_part or "\\" in module_part:
            return _import_file(self.spec.base_dir / module_part)
        try:
            return importlib.import_module(module_part)
        except ModuleNotFoundError as exc:
            raise _ImportProblem(f"no module named {exc.name!r}") from None
        except Exception as exc:
            raise _ImportProblem(_describe_import_error(exc)) from None

    def check_ports(self, stage: StageSpec, cls: type[Stage]) -> bool:
        ok = True
        for kind in ("inputs", "outputs"):
            ports = getattr(cls, kind, None)
            if not isinstance(ports, dict):
                self.problem(
                    f"stage {stage.name!r}: {cls.__name__}.{kind} must be a dict of port -> type",
                    stage.line,
                )
                ok = False
                continue
            for port, tp in ports.items():
                try:
                    type_members(tp)
                except TypeError:
                    self.problem(
                        f"stage {stage.name!r}: {cls.__name__}.{kind}[{port!r}] = {tp!r} "
                        "is not a message type",
                        stage.line,
                    )
                    ok = False
        return ok

    def check_params(self, stage: StageSpec, cls: type[Stage]) -> msgspec.Struct | None:
        where = f"stage {stage.name!r} ({cls.__name__})"
        ptype = cls.Params
        if not (isinstance(ptype, type) and issubclass(ptype, msgspec.Struct)):
            self.problem(f"{where}: {cls.__name__}.Params must be a msgspec Struct", stage.line)
            return None
        fields = {f.name: f for f in msgspec.structs.fields(ptype)}
        ok = True
        for key, value in stage.params.items():
            info = fields.get(key)
            if info is None:
                known = f"; known params: {_known(fields)}" if fields else "; it takes no params"
                self.problem(
                    f"{where}: unknown param {key!r}{_suggest(str(key), list(fields))}{known}",
                    stage.line,
                )
                ok = False
                continue
            try:
                msgspec.convert(value, info.type)
            except (msgspec.ValidationError, TypeError) as exc:
                self.problem(
                    f"{where}: param {key!r} must be {type_name_of(info.type)}, "
                    f"got {value!r} ({type(value).__name__}): {exc}",
                    stage.line,
                )
                ok = False
        for name, info in fields.items():
            if info.required and name not in stage.params:
                self.problem(
                    f"{where}: missing required param {name!r} ({type_name_of(info.type)})",
                    stage.line,
                )
                ok = False
        if not ok:
            return None
        try:
            return msgspec.convert(stage.params, ptype)
        except (msgspec.ValidationError, TypeError, ValueError) as exc:
            self.problem(f"{where}: invalid params: {exc}", stage.line)
            return None

    # -- edges ----------------------------------------------------------------------------

    def check_edges(self, stages: dict[str, BoundStage]) -> list[EdgeSpec]:
        """The edges whose ends resolve; problems for the rest and for type mismatches."""
        good: list[EdgeSpec] = []
        seen: dict[tuple[PortRef, PortRef], int | None] = {}
        for edge in self.spec.edges:
            key = (edge.src, edge.dst)
            if key in seen:
                self.problem(
                    f"edge '{edge}' is listed twice (first at line {seen[key]})", edge.line
                )
                continue
            seen[key] = edge.line
            src_type = self.port_type(edge, edge.src, "outputs", stages)
            dst_type = self.port_type(edge, edge.dst, "inputs", stages)
            if src_type is _MISSING or dst_type is _MISSING:
                continue
            self.check_types(edge, src_type, dst_type)
            good.append(edge)
        return good

    def port_type(
        self, edge: EdgeSpec, ref: PortRef, kind: str, stages: dict[str, BoundStage]
    ) -> Any:
        bound = stages.get(ref.stage)
        if bound is None:
            if ref.stage not in self.known_names:
                self.problem(
                    f"edge '{edge}': unknown stage {ref.stage!r}"
                    f"{_suggest(ref.stage, self.known_names)}",
                    edge.line,
                )
            return _MISSING  # a known stage that failed to resolve was reported already
        ports: dict[str, Any] = getattr(bound.cls, kind)
        if ref.port in ports:
            return ports[ref.port]
        other_kind = "inputs" if kind == "outputs" else "outputs"
        role = "output" if kind == "outputs" else "input"
        if ref.port in getattr(bound.cls, other_kind):
            hint = (
                f"; {ref} is an {'input' if role == 'output' else 'output'} port, and edges "
                "go from an output port to an input port"
            )
        else:
            hint = _suggest(ref.port, list(ports)) + f"; its {role} ports: {_known(ports)}"
        self.problem(
            f"edge '{edge}': stage {ref.stage!r} ({bound.cls.__name__}) has no {role} port "
            f"{ref.port!r}{hint}",
            edge.line,
        )
        return _MISSING

    def check_types(self, edge: EdgeSpec, src_type: Any, dst_type: Any) -> None:
        accepted = type_members(dst_type)
        if accepted is None:
            return
        sent = type_members(src_type)
        if sent is None:
            rejected = ["Any"]
        else:
            rejected = [
                "None" if t is type(None) else t.__name__
                for t in sent
                if not any(issubclass(t, a) for a in accepted)
            ]
        if rejected:
            self.problem(
                f"edge '{edge}': type mismatch: {edge.src} sends {type_name(src_type)} but "
                f"{edge.dst} accepts {type_name(dst_type)} ({', '.join(rejected)} not accepted)",
                edge.line,
            )

    def check_unconnected(self, stages: dict[str, BoundStage], edges: list[EdgeSpec]) -> None:
        connected = {e.src for e in edges} | {e.dst for e in edges}
        # A port named by an edge that failed for another reason is not reported twice, nor
        # is the port a mistyped name suggests: that edge's problem already points at it.
        named = {e.src for e in self.spec.edges} | {e.dst for e in self.spec.edges}
        for edge in self.spec.edges:
            for ref, kind in ((edge.src, "outputs"), (edge.dst, "inputs")):
                bound = stages.get(ref.stage)
                ports = list(getattr(bound.cls, kind)) if bound is not None else []
                if ports and ref.port not in ports:
                    close = difflib.get_close_matches(ref.port, ports, n=1, cutoff=0.6)
                    named.update(PortRef(ref.stage, port) for port in close)
        for bound in stages.values():
            for kind, role in (("inputs", "input"), ("outputs", "output")):
                for port, tp in getattr(bound.cls, kind).items():
                    ref = PortRef(bound.name, port)
                    if ref in connected or ref in named:
                        continue
                    if kind == "inputs" and port in bound.cls.optional_inputs:
                        continue
                    direction = "from" if role == "output" else "into"
                    self.problem(
                        f"stage {bound.name!r}: {role} port {port!r} ({type_name(tp)}) is not "
                        f"connected; add an edge {direction} {ref}",
                        bound.spec.line,
                    )

    def build_channels(
        self, stages: dict[str, BoundStage], edges: list[EdgeSpec]
    ) -> tuple[dict[str, ChannelSpec], dict[PortRef, tuple[str, ...]]]:
        by_dst: dict[PortRef, list[EdgeSpec]] = {}
        for edge in edges:
            by_dst.setdefault(edge.dst, []).append(edge)
        channels: dict[str, ChannelSpec] = {}
        for dst, into in by_dst.items():
            # Only edges between resolved stages reach here (check_edges dropped the rest).
            channels[str(dst)] = ChannelSpec(
                str(dst),
                dst,
                stages[dst.stage].cls.inputs[dst.port],
                max(e.capacity for e in into),
                tuple(e.src for e in into),
            )
        fanout: dict[PortRef, list[str]] = {}
        for edge in edges:
            fanout.setdefault(edge.src, []).append(str(edge.dst))
        return channels, {src: tuple(names) for src, names in fanout.items()}

    # -- cycles ---------------------------------------------------------------------------

    def check_cycles(
        self,
        stages: dict[str, BoundStage],
        edges: list[EdgeSpec],
        channels: dict[str, ChannelSpec],
    ) -> None:
        order = [s.name for s in self.spec.stages if s.name in stages]
        succ: dict[str, dict[str, list[EdgeSpec]]] = {name: {} for name in order}
        for edge in edges:
            if edge.src.stage in succ and edge.dst.stage in succ:
                succ[edge.src.stage].setdefault(edge.dst.stage, []).append(edge)
        for cycle in _simple_cycles(order, {n: list(s) for n, s in succ.items()}):
            on_cycle: list[EdgeSpec] = []
            for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True):
                on_cycle.extend(succ[a][b])
            path = " -> ".join([*cycle, cycle[0]])
            line = min((e.line for e in on_cycle if e.line is not None), default=None)
            bounds = {n: stages[n].credit_bound for n in cycle}
            credited = {n: b for n, b in bounds.items() if b is not None}
            if not credited:
                self.problem(
                    f"cycle {path} is not credit-bounded: no stage on it declares a credit "
                    "bound (a Stage with credit_param, like schedule's max_inflight_steps), so "
                    "its bounded channels can deadlock",
                    line,
                )
                continue
            holder, bound = min(credited.items(), key=lambda item: item[1])
            param = stages[holder].cls.credit_param
            replicas = stages[holder].spec.replicas
            if replicas > 1:
                param = f"{param} x {replicas} replicas"
            if bound < 1:
                self.problem(
                    f"cycle {path}: stage {holder!r} has credit bound {bound} ({param}); "
                    "it must be >= 1 for work to flow",
                    stages[holder].spec.line,
                )
                continue
            for channel_name in dict.fromkeys(str(e.dst) for e in on_cycle):
                capacity = channels[channel_name].capacity
                if capacity < bound:
                    self.problem(
                        f"cycle {path}: channel {channel_name!r} has capacity {capacity}, below "
                        f"the credit bound {bound} of stage {holder!r} ({param}); give it "
                        f"capacity >= {bound}",
                        line,
                    )


_MISSING: Any = object()


class _ImportProblem(Exception):
    """Why a `use:` module could not be imported."""


def _describe_import_error(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _import_file(path: Path) -> ModuleType:
    """Import a user's stage file once per process, under a name derived from its path."""
    path = path.resolve()
    if not path.is_file():
        raise _ImportProblem(f"file {str(path)!r} does not exist")
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module_name = f"flowllm_user_stages.{path.stem}_{digest}"
    existing = sys.modules.get(module_name)
    if existing is not None:
        return existing
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise _ImportProblem(f"cannot load {str(path)!r} as Python")
    module = importlib.util.module_from_spec(spec)
    # Registered before executing so msgspec/typing can resolve the module's annotations.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise _ImportProblem(_describe_import_error(exc)) from None
    return module


def type_name_of(tp: Any) -> str:
    """A param type's name for messages: `int`, `float | None`, `tuple[str, ...]`."""
    if isinstance(tp, type) and not hasattr(tp, "__origin__"):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _simple_cycles(order: list[str], succ: dict[str, list[str]]) -> Iterator[list[str]]:
    """Elementary cycles of a small directed graph, each starting at its first node in `order`.

    For each start node s, a depth-first search over nodes after s in `order` finds every
    path back to s, so each cycle is found exactly once. Stops after MAX_CYCLES_CHECKED.
    """
    index = {name: i for i, name in enumerate(order)}
    found = 0
    for start in order:
        s = index[start]
        stack: list[tuple[str, Iterator[str]]] = [(start, iter(succ[start]))]
        path = [start]
        on_path = {start}
        while stack:
            _node, children = stack[-1]
            advanced = False
            for child in children:
                if child == start:
                    yield list(path)
                    found += 1
                    if found >= MAX_CYCLES_CHECKED:
                        return
                elif index[child] > s and child not in on_path:
                    stack.append((child, iter(succ[child])))
                    path.append(child)
                    on_path.add(child)
                    advanced = True
                    break
            if not advanced:
                stack.pop()
                on_path.discard(path.pop())
