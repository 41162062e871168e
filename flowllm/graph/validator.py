"""A `GraphSpec` bound and checked into a `ValidGraph`, reporting every problem at once.

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
>= B, so no send on the cycle can block. A cycle inside such a loop (every stage on it also
on a credited cycle, like the sampled ids that `sample` hands back to `execute`) carries at
most one message a step too, so the loop's bound B holds for it and the same capacity rule
applies.

A port sending up to one message per step beside that loop (`Stage.per_step_outputs`, e.g.
`schedule.choices`) is not bounded by B: its steps stop only once its consumer's input from
the loop is full. Its channel, when on a cycle, needs that input's capacity + B + 1 instead.
When every credited cycle passes through that consumer (the pooling graph's `pool`), each
step's credit returns through it: the steps stop with it, and a full channel only makes its
sender wait for it, so any capacity does.

Placement. Stages that name a `process:` must all name one; an edge between processes
must carry messages with a wire encoding (flowllm/graph/wire.py), and holds its capacity
on each side of the boundary, which the capacity rules count (`ChannelSpec.held`).
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Final

import msgspec

from flowllm.graph.channel import type_members, type_name
from flowllm.graph.cycles import simple_cycles
from flowllm.graph.problems import GraphValidationError, Problem, known, suggest
from flowllm.graph.spec import EdgeSpec, GraphSpec, PortRef, StageSpec
from flowllm.graph.stage import Stage
from flowllm.graph.stage_import import StageImportError, describe_import_error, import_file
from flowllm.graph.supervision import (
    Supervision,
    SupervisionPlan,
    parse_supervision,
    plan_groups,
)
from flowllm.graph.wire import wire_problem


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
    message_type: object  # a type, or a union of types
    capacity: int
    producers: tuple[PortRef, ...]
    crosses: bool = False  # some producer runs in another process than the consumer

    @property
    def held(self) -> int:
        """The most messages the channel holds: its capacity, or twice that across a
        process boundary (capacity in transit, capacity in the consumer's process)."""
        return 2 * self.capacity if self.crosses else self.capacity


@dataclass(frozen=True)
class ValidGraph:
    """A graph that passed validation: what the runtime builds."""

    spec: GraphSpec
    stages: dict[str, BoundStage]
    channels: dict[str, ChannelSpec]  # by input port "stage.port"
    fanout: dict[PortRef, tuple[str, ...]]  # output port -> the channels it feeds
    placement: dict[str, str] = field(default_factory=dict)  # stage -> process; {}: one

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def processes(self) -> tuple[str, ...]:
        """The processes the graph is placed in, in order of first mention (() if one)."""
        return tuple(dict.fromkeys(self.placement.values()))


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
        placement = self.check_placement(stages)
        channels, fanout = self.build_channels(stages, edges, placement)
        self.check_cycles(stages, edges, channels)
        if self.problems:
            # In file order; problems without a line (file-level) first. sorted() is stable.
            raise GraphValidationError(sorted(self.problems, key=lambda p: p.line or 0))
        return ValidGraph(self.spec, stages, channels, fanout, placement)

    def check_placement(self, stages: dict[str, BoundStage]) -> dict[str, str]:
        """Every stage's process, or {} when none names one."""
        placed = [s for s in self.spec.stages if s.process is not None]
        if not placed:
            return {}
        for stage in self.spec.stages:
            if stage.process is None:
                self.problem(
                    f"stage {stage.name!r} names no process, but other stages do "
                    f"({placed[0].name!r}: {placed[0].process!r}); place every stage or none",
                    stage.line,
                )
        return {name: bound.spec.process or "" for name, bound in stages.items()}

    # -- stages ---------------------------------------------------------------------------

    def check_stages(self) -> dict[str, BoundStage]:
        resolved: dict[str, tuple[StageSpec, type[Stage], msgspec.Struct, Supervision]] = {}
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
        except StageImportError as exc:
            self.problem(f"{where}: cannot import {module_part!r}: {exc}", stage.line)
            return None
        obj = getattr(module, attr, None)
        if obj is None:
            names = [n for n, v in vars(module).items() if isinstance(v, type)]
            self.problem(
                f"{where}: {module_part!r} has no attribute {attr!r}{suggest(attr, names)}",
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
            return import_file(self.spec.base_dir / module_part)
        try:
            return importlib.import_module(module_part)
        except ModuleNotFoundError as exc:
            raise StageImportError(f"no module named {exc.name!r}") from None
        except Exception as exc:
            raise StageImportError(describe_import_error(exc)) from None

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
        if not ok:
            return False
        where = f"stage {stage.name!r}: {cls.__name__}.per_step_outputs"
        stray = sorted(set(cls.per_step_outputs) - set(cls.outputs))
        if stray:
            self.problem(
                f"{where} names {', '.join(map(repr, stray))}, not an output port; its "
                f"output ports: {known(cls.outputs)}",
                stage.line,
            )
            ok = False
        if cls.per_step_outputs and cls.credit_param is None:
            self.problem(
                f"{where} needs a credit_param: only the steps a stage keeps in flight bound "
                "what it sends once a step",
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
                listed = f"; known params: {known(fields)}" if fields else "; it takes no params"
                self.problem(
                    f"{where}: unknown param {key!r}{suggest(str(key), list(fields))}{listed}",
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
    ) -> object:
        bound = stages.get(ref.stage)
        if bound is None:
            if ref.stage not in self.known_names:
                self.problem(
                    f"edge '{edge}': unknown stage {ref.stage!r}"
                    f"{suggest(ref.stage, self.known_names)}",
                    edge.line,
                )
            return _MISSING  # a known stage that failed to resolve was reported already
        ports: dict[str, object] = getattr(bound.cls, kind)
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
            hint = suggest(ref.port, list(ports)) + f"; its {role} ports: {known(ports)}"
        self.problem(
            f"edge '{edge}': stage {ref.stage!r} ({bound.cls.__name__}) has no {role} port "
            f"{ref.port!r}{hint}",
            edge.line,
        )
        return _MISSING

    def check_types(self, edge: EdgeSpec, src_type: object, dst_type: object) -> None:
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
                    optional = "optional_inputs" if kind == "inputs" else "optional_outputs"
                    if port in getattr(bound.cls, optional):
                        continue
                    direction = "from" if role == "output" else "into"
                    self.problem(
                        f"stage {bound.name!r}: {role} port {port!r} ({type_name(tp)}) is not "
                        f"connected; add an edge {direction} {ref}",
                        bound.spec.line,
                    )

    def build_channels(
        self, stages: dict[str, BoundStage], edges: list[EdgeSpec], placement: dict[str, str]
    ) -> tuple[dict[str, ChannelSpec], dict[PortRef, tuple[str, ...]]]:
        by_dst: dict[PortRef, list[EdgeSpec]] = {}
        for edge in edges:
            by_dst.setdefault(edge.dst, []).append(edge)
        channels: dict[str, ChannelSpec] = {}
        for dst, into in by_dst.items():
            # Only edges between resolved stages reach here (check_edges dropped the rest).
            message_type = stages[dst.stage].cls.inputs[dst.port]
            crossing = [e for e in into if placement.get(e.src.stage) != placement.get(dst.stage)]
            problem = wire_problem(message_type) if crossing else None
            if problem is not None:
                edge = crossing[0]
                self.problem(
                    f"edge {edge} crosses from process {placement[edge.src.stage]!r} to "
                    f"{placement[dst.stage]!r}, but its messages cannot: {problem}; place "
                    "both stages in one process",
                    edge.line,
                )
            channels[str(dst)] = ChannelSpec(
                str(dst),
                dst,
                message_type,
                max(e.capacity for e in into),
                tuple(e.src for e in into),
                crosses=bool(crossing),
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
        cycles = list(simple_cycles(order, {n: list(s) for n, s in succ.items()}))
        per_step_checked: set[str] = set()
        for cycle in cycles:
            on_cycle: list[EdgeSpec] = []
            for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True):
                on_cycle.extend(succ[a][b])
            path = " -> ".join([*cycle, cycle[0]])
            line = min((e.line for e in on_cycle if e.line is not None), default=None)
            credited = credit_bounds(cycle, stages)
            if not credited:  # a cycle inside a credited loop takes the loop's bound
                members = set(cycle)
                for loop in cycles:
                    if members <= set(loop):
                        credited.update(credit_bounds(loop, stages))
            if not credited:
                self.problem(
                    f"cycle {path} is not credit-bounded: no stage on it declares a credit "
                    "bound (a Stage with credit_param, like schedule's max_inflight_steps), so "
                    "its bounded channels can deadlock",
                    line,
                )
                continue
            holder, bound = min(credited.items(), key=lambda item: item[1])
            if bound < 1:
                self.problem(
                    f"cycle {path}: stage {holder!r} has credit bound {bound} "
                    f"({credit_source(stages[holder])}); it must be >= 1 for work to flow",
                    stages[holder].spec.line,
                )
                continue
            for channel_name, edge in {str(e.dst): e for e in on_cycle}.items():
                head_bound = per_step_bound(edge.src, stages)
                if head_bound is not None:
                    if channel_name not in per_step_checked:
                        per_step_checked.add(channel_name)
                        self.check_per_step(edge, head_bound, path, stages, channels, cycles, succ)
                    continue
                capacity = channels[channel_name].capacity
                if capacity < bound:
                    self.problem(
                        f"cycle {path}: channel {channel_name!r} has capacity {capacity}, below "
                        f"the credit bound {bound} of stage {holder!r} "
                        f"({credit_source(stages[holder])}); give it capacity >= {bound}",
                        line,
                    )

    def check_per_step(
        self,
        edge: EdgeSpec,
        bound: int,
        path: str,
        stages: dict[str, BoundStage],
        channels: dict[str, ChannelSpec],
        cycles: list[list[str]],
        succ: dict[str, dict[str, list[EdgeSpec]]],
    ) -> None:
        """A per-step port's channel on a cycle: it holds a message for every step its
        consumer has not taken yet, which the consumer's input from the credited loop bounds
        (that input's capacity, the steps in flight, and one its producer holds back)."""
        head, consumer = stages[edge.src.stage], edge.dst.stage
        loop: set[str] = set()  # on cycles leaving `head` by a credited port, not via `consumer`
        credit_through_consumer = False
        for cycle in cycles:
            if head.name in cycle:
                after = cycle[(cycle.index(head.name) + 1) % len(cycle)]
                if any(per_step_bound(e.src, stages) is None for e in succ[head.name][after]):
                    if consumer in cycle:
                        credit_through_consumer = True
                    else:
                        loop.update(cycle)
        if credit_through_consumer and not loop:
            return  # every step's credit returns through the consumer: see the module docstring
        intakes = [
            channel
            for channel in channels.values()
            if channel.dst.stage == consumer
            and any(
                p.stage in loop and per_step_bound(p, stages) is None for p in channel.producers
            )
        ]
        name = str(edge.dst)
        if not intakes:
            self.problem(
                f"cycle {path}: channel {name!r} is not bounded: {edge.src} sends up to one "
                f"message per step of stage {head.name!r}, but no input of stage "
                f"{consumer!r} is fed by that stage's credited loop, so the steps do not stop "
                f"while {consumer!r} waits; feed {consumer!r} from the loop or break the cycle",
                edge.line,
            )
            return
        channel = channels[name]
        # Run in one process, the channels hold their capacities; placed across
        # processes, what each holds (`held`): the rule must hold either way.
        intake = max(intakes, key=lambda c: c.held)
        if channel.crosses or intake.crosses:
            needed = intake.held + bound + 1
            if channel.held < needed:
                self.problem(
                    f"cycle {path}: channel {name!r} holds {channel.held} across processes, "
                    f"below the {needed} it needs: {edge.src} sends up to one message per "
                    f"step, and stage {head.name!r} stops starting steps only once "
                    f"{intake.name!r} is full (it holds {intake.held}); give it capacity "
                    f">= {-(-needed // (2 if channel.crosses else 1))}",
                    edge.line,
                )
                return
        intake = max(intakes, key=lambda c: c.capacity)
        needed = intake.capacity + bound + 1
        capacity = channel.capacity
        if capacity < needed:
            self.problem(
                f"cycle {path}: channel {name!r} has capacity {capacity}, below the {needed} "
                f"it needs: {edge.src} sends up to one message per step, and stage "
                f"{head.name!r} stops starting steps only once {intake.name!r} is full; give "
                f"it capacity >= {needed} (capacity {intake.capacity} of {intake.name!r} + the "
                f"credit bound {bound} of stage {head.name!r} ({credit_source(head)}) + 1)",
                edge.line,
            )


_MISSING: Final = object()


def credit_bounds(cycle: list[str], stages: dict[str, BoundStage]) -> dict[str, int]:
    """The credit bound of each stage on `cycle` that declares one."""
    bounds = {name: stages[name].credit_bound for name in cycle}
    return {name: bound for name, bound in bounds.items() if bound is not None}


def per_step_bound(port: PortRef, stages: dict[str, BoundStage]) -> int | None:
    """The credit bound of `port`'s stage when `port` sends up to one message per step of
    it (`Stage.per_step_outputs`), else None."""
    stage = stages[port.stage]
    return stage.credit_bound if port.port in stage.cls.per_step_outputs else None


def credit_source(stage: BoundStage) -> str:
    """What a stage's credit bound comes from: `max_inflight_steps x 2 replicas`."""
    replicas = stage.spec.replicas
    param = str(stage.cls.credit_param)
    return f"{param} x {replicas} replicas" if replicas > 1 else param


def type_name_of(tp: object) -> str:
    """A param type's name for messages: `int`, `float | None`, `tuple[str, ...]`."""
    if isinstance(tp, type) and not hasattr(tp, "__origin__"):
        return tp.__name__
    return str(tp).replace("typing.", "")


def validate_graph(spec: GraphSpec) -> ValidGraph:
    """Resolve `spec`'s classes and params and check its wiring; raises with every problem."""
    return _Validator(spec).validate()


def load_graph(path: str | Path) -> ValidGraph:
    """Load and validate a graph file in one step."""
    return validate_graph(GraphSpec.load(path))
