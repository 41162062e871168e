"""Replay a trace into fresh stages and compare what they emit with what was recorded.

Each stage is built from the trace's own graph and engine config (`StageClass(params,
services)`), then fed its recorded inputs in the order it received them when recording:
for a stage with one input, or one that joins its inputs by step (sample), send order; for
several (schedule, deliver), the order of its recorded spans, one message at a time, the
next sent once the stage has recorded the previous one's span (which it does before taking
its next input, so its decisions between inputs are the same as when recording). Its
outputs are compared with the recorded ones port by port: exactly, except

- request ids map one-to-one in order of appearance, and `*_time` fields are ignored;
- tensors (execute's logits) are equal within `atol + rtol * |recorded|` (default 1e-4
  each); a logits digest (compact traces) is checked on its top-k and row moments, and
  the stage downstream of it (sample) is fed the replayed tensors instead;
- floats (logprobs) are equal within the same bounds: they come from those logits, which
  this machine's kernels may sum in another order than the recording's.

State is rebuilt by replay itself: execute's KV cache from all its StepBatches in order,
sample's unseeded generator from the engine config's seed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from time import perf_counter
from typing import Any

import anyio
import msgspec
import structlog

from flowllm.graph.channel import Channel
from flowllm.graph.metrics import GraphMetrics
from flowllm.graph.spans import InputClosed, SpanRecorder
from flowllm.graph.stage import Outbox, SourceStage, Stage, StageContext
from flowllm.mailbox import Mailbox, Mailboxes
from flowllm.messages import Chunk, RequestError
from flowllm.traces.codec import TensorDigest
from flowllm.traces.compare import Comparer, show
from flowllm.traces.trace import Trace, load_trace, producer_of
from flowllm.traces.trace_model import build_replay_services, resolve_model

ATOL = 1e-4
RTOL = 1e-4
STAGE_TIMEOUT = 120.0
INPUT_END: Any = object()  # in a replayed input sequence: the port ended here


class ReplayError(RuntimeError):
    """A trace cannot be replayed here (a stage it names is unknown, or not in the trace)."""


class Difference(msgspec.Struct, kw_only=True):
    """The first message that differs on one output port."""

    port: str
    index: int
    path: str  # where inside the message, e.g. ".tokens[0].token_id"
    recorded: str  # the recorded message, pretty-printed
    replayed: str

    def side_by_side(self, width: int = 58) -> str:
        left = self.recorded.splitlines() or ["(none)"]
        right = self.replayed.splitlines() or ["(none)"]
        lines = [f"  {'recorded':<{width}}   replayed"]
        for i in range(max(len(left), len(right))):
            a = left[i] if i < len(left) else ""
            b = right[i] if i < len(right) else ""
            mark = " " if a == b else "|"
            lines.append(f"  {a[:width]:<{width}} {mark} {b[:width]}")
        return "\n".join(lines)


class StageResult(msgspec.Struct, kw_only=True):
    stage: str
    status: str  # "pass", "fail" or "skip"
    inputs: int = 0
    outputs: int = 0
    seconds: float = 0.0
    detail: str = ""
    difference: Difference | None = None

    @property
    def ok(self) -> bool:
        return self.status != "fail"


class ReplayReport(msgspec.Struct, kw_only=True):
    trace: str
    results: list[StageResult]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def result(self, stage: str) -> StageResult:
        for r in self.results:
            if r.stage == stage:
                return r
        raise KeyError(stage)

    def format(self) -> str:
        """The pass/fail table, then each failure's first differing message."""
        lines = [f"trace {self.trace}", f"{'stage':<12} {'result':<6} {'in':>5} {'out':>5}  detail"]
        for r in self.results:
            lines.append(
                f"{r.stage:<12} {r.status.upper():<6} {r.inputs:>5} {r.outputs:>5}  {r.detail}"
            )
        for r in self.results:
            if r.difference is not None:
                d = r.difference
                lines.append("")
                lines.append(
                    f"{r.stage}: first difference on port {d.port!r}, message #{d.index}, "
                    f"at {d.path or '(whole message)'}"
                )
                lines.append(d.side_by_side())
        return "\n".join(lines)


# -- running one stage ------------------------------------------------------------------


class _Harness:
    """One stage instance wired to private channels: a feeder in, collectors out."""

    def __init__(self, name: str, stage: Stage, ports: Iterable[str]) -> None:
        self.name = name
        self.stage = stage
        cls = type(stage)
        self.inputs: dict[str, Channel[Any]] = {
            p: Channel(f"{name}.{p}", cls.inputs[p], 1 << 20) for p in ports
        }
        self.outputs: dict[str, Channel[Any]] = {
            p: Channel(f"{name}>{p}", t, 1 << 20) for p, t in cls.outputs.items()
        }
        self.emitted: dict[str, list[Any]] = {p: [] for p in cls.outputs}
        self.handled = 0
        self._progress = anyio.Event()
        log = structlog.get_logger("flowllm.replay").bind(stage=name)
        self.senders = {p: c.sender() for p, c in self.inputs.items()}
        self.ctx = StageContext(
            name=name,
            replica=0,
            inboxes={p: c.receiver() for p, c in self.inputs.items()},
            outboxes={p: Outbox(p, [c.sender()]) for p, c in self.outputs.items()},
            log=log,
            spans=SpanRecorder(name, log, GraphMetrics(), events=False, sinks=(self._on_span,)),
            stop_requested=anyio.Event(),
        )
        self._receivers = {p: c.receiver() for p, c in self.outputs.items()}
        for channel in (*self.inputs.values(), *self.outputs.values()):
            channel.close()
        stage.bind(self.ctx)

    def _on_span(self, _stage: str, message: Any, *_: Any) -> None:
        if isinstance(message, InputClosed):
            return
        self.handled += 1
        self._progress.set()

    async def wait_handled(self, count: int) -> None:
        while self.handled < count:
            self._progress = anyio.Event()
            if self.handled >= count:
                return
            await self._progress.wait()

    async def collect(self, port: str) -> None:
        async for message in self._receivers[port]:
            self.emitted[port].append(message)

    def close_inputs(self) -> None:
        for sender in self.senders.values():
            sender.close()


async def _run_harness(
    harness: _Harness,
    inputs: list[tuple[str, Any]],
    one_at_a_time: bool,
    outputs: Mapping[str, list[Any]],
) -> BaseException | None:
    """Run the stage over `inputs`; returns what it raised, if anything."""
    error: BaseException | None = None
    stage = harness.stage

    async def run_stage() -> None:
        nonlocal error
        try:
            await stage.run(harness.ctx)
        except Exception as e:
            error = e
        finally:
            harness.ctx.close()
            harness._progress.set()

    async def feed() -> None:
        if isinstance(stage, SourceStage):
            await _drive_source(stage, outputs)
            harness.ctx.stop_requested.set()
            return
        count = 0
        for port, message in inputs:
            if error is not None:
                break
            if message is INPUT_END:  # the input ended here when recording
                harness.senders[port].close()
                # the stage sees the close before the next message, as when recording
                await anyio.lowlevel.checkpoint()
                continue
            await harness.senders[port].send(message)
            count += 1
            if one_at_a_time:
                await harness.wait_handled(count)
        harness.close_inputs()

    with anyio.fail_after(STAGE_TIMEOUT):
        async with anyio.create_task_group() as tg:
            for port in harness.outputs:
                tg.start_soon(harness.collect, port)
            tg.start_soon(run_stage)
            await feed()
    return error


async def _drive_source(stage: Stage, outputs: Mapping[str, list[Any]]) -> None:
    """A source stage (ingest) is driven by its owner's calls: submit what it sent."""
    from flowllm.messages import Abort, GenerateRequest

    for messages in outputs.values():
        for message in messages:
            if isinstance(message, GenerateRequest):
                stage.submit(message)  # type: ignore[attr-defined]
            elif isinstance(message, Abort):
                stage.abort(message.request_id)  # type: ignore[attr-defined]
            await anyio.lowlevel.checkpoint()


class _RecordingMailboxes(Mailboxes):
    """Mailboxes that log every chunk delivered and every error failed, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[Any] = []

    def open_for(self, messages: Iterable[Any]) -> None:
        """Open a mailbox for every request the messages name (with all its choices)."""
        choices: dict[str, int] = {}
        for message in messages:
            for chunk in getattr(message, "chunks", ()):
                choices[chunk.request_id] = max(choices.get(chunk.request_id, 0), chunk.index + 1)
            if isinstance(message, RequestError):
                choices.setdefault(message.request_id, 1)
        for request_id, n in choices.items():
            self.open(request_id, n, 0.0)

    def deliver_to(self, box: Mailbox, chunk: Chunk, now: float | None = None) -> None:
        super().deliver_to(box, chunk, now)  # `deliver` comes here too
        self.log.append(chunk)

    def fail(self, error: RequestError) -> Mailbox | None:
        box = super().fail(error)
        if box is not None:
            self.log.append(error)
        return box


def _expected_deliveries(messages: Iterable[Any]) -> list[Any]:
    """What a sink owes the mailboxes for these inputs: every chunk, every error, in
    order, nothing for a request after its error or after all its choices finished."""
    messages = list(messages)
    choices: dict[str, int] = {}
    for message in messages:
        for chunk in getattr(message, "chunks", ()):
            choices[chunk.request_id] = max(choices.get(chunk.request_id, 0), chunk.index + 1)
    out: list[Any] = []
    unfinished = {request_id: set(range(n)) for request_id, n in choices.items()}
    closed: set[str] = set()
    for message in messages:
        if isinstance(message, RequestError):
            if message.request_id not in closed:
                out.append(message)
                closed.add(message.request_id)
            continue
        for chunk in getattr(message, "chunks", ()):
            if chunk.request_id in closed:
                continue
            out.append(chunk)
            left = unfinished[chunk.request_id]
            if chunk.finish_reason is not None:
                left.discard(chunk.index)
                if not left:
                    closed.add(chunk.request_id)
    return out


def _has_digest(message: Any) -> bool:
    return isinstance(getattr(message, "logits", None), TensorDigest)


class Replayer:
    """Replays the stages of one trace (the library call behind `flowllm trace replay`)."""

    def __init__(
        self,
        trace: Trace,
        services: Any,
        *,
        stage_overrides: Mapping[str, type[Stage]] | None = None,
        atol: float = ATOL,
        rtol: float = RTOL,
    ) -> None:
        self.trace = trace
        self.services = services
        self.overrides = dict(stage_overrides or {})
        self.atol = atol
        self.rtol = rtol
        self._emitted: dict[str, dict[str, list[Any]]] = {}
        self._results: dict[str, StageResult] = {}

    def stage_names(self) -> list[str]:
        return list(self.trace.graph.stages)

    def replay(self, stage: str) -> StageResult:
        if stage in self._results:
            return self._results[stage]
        if stage not in self.trace.graph.stages:
            raise ReplayError(
                f"the trace's graph has no stage {stage!r}; it has {', '.join(self.stage_names())}"
            )
        started = perf_counter()
        result = self._replay(stage)
        result.seconds = perf_counter() - started
        self._results[stage] = result
        return result

    def _recorded_outputs(self, stage: str) -> dict[str, list[Any] | None]:
        """Port -> recorded messages (None when none of the port's channels was recorded)."""
        found: dict[str, list[Any] | None] = {}
        trace = self.trace
        for port, channels in trace.stage_outputs(stage).items():
            recorded = [c for c in channels if c in trace.entries]
            if not recorded:
                found[port] = None
                continue
            # Prefer a channel this stage alone feeds; on a fan-in channel (errors), keep
            # the entries this stage sent, told apart by the spans open at each send.
            recorded.sort(key=lambda c: len(trace.graph.channels[c].producers))
            channel = recorded[0]
            entries = trace.entries[channel]
            if len(trace.graph.channels[channel].producers) > 1:
                if not trace.spans:
                    found[port] = None
                    continue
                entries = [e for e in entries if producer_of(trace, channel, e) == stage]
            found[port] = [e.message for e in entries]
        return found

    def _inputs(
        self, stage: str, joins_inputs: bool = False
    ) -> tuple[list[tuple[str, Any]], bool] | str:
        """(port, message) in receive order and whether to feed one at a time, or why not.
        A stage that `joins_inputs` gets each input in send order, one input after another."""
        trace = self.trace
        ports = trace.stage_inputs(stage)
        missing = [c for c in ports.values() if c not in trace.entries]
        if missing:
            return f"input channel(s) not recorded: {', '.join(missing)}"
        port_of = {channel: port for port, channel in ports.items()}
        if len(ports) == 1 or joins_inputs:
            return [(p, e.message) for p, c in ports.items() for e in trace.entries[c]], False
        handled = trace.handled.get(stage, [])
        if not trace.manifest.spans and any(trace.entries[c] for c in ports.values()):
            return "several inputs and no spans recorded: receive order unknown"
        closes = trace.closes.get(stage, [])
        ordered: list[tuple[str, Any]] = []
        for k, h in enumerate(handled):
            ordered += [(port, INPUT_END) for at, port in closes if at == k]
            if h.channel is None or h.index is None:
                return f"a span of {stage} matches no recorded input: receive order unknown"
            ordered.append((port_of[h.channel], trace.entries[h.channel][h.index].message))
        ordered += [(port, INPUT_END) for at, port in closes if at >= len(handled)]
        return ordered, True

    def _substitute_digests(
        self, stage: str, inputs: list[tuple[str, Any]]
    ) -> list[tuple[str, Any]] | str:
        """Compact traces hold logits digests: feed the producing stage's replayed outputs."""
        if not any(_has_digest(m) for _, m in inputs if m is not INPUT_END):
            return inputs
        channels = self.trace.stage_inputs(stage)
        fixed: list[tuple[str, Any]] = []
        counters: dict[str, int] = {}
        for port, message in inputs:
            if not _has_digest(message):
                fixed.append((port, message))
                continue
            spec = self.trace.graph.channels[channels[port]]
            if len(spec.producers) != 1:
                return "digested inputs from several producers"
            producer = spec.producers[0]
            upstream = self.replay(producer.stage)
            if upstream.status != "pass":
                return f"inputs are digests re-derived from {producer.stage}, which did not pass"
            produced = self._emitted[producer.stage][producer.port]
            i = counters.get(port, 0)
            counters[port] = i + 1
            if i >= len(produced):
                return f"{producer.stage} replayed fewer messages than {stage} received"
            fixed.append((port, produced[i]))
        return fixed

    def _replay(self, name: str) -> StageResult:
        trace = self.trace
        bound = trace.graph.stages[name]
        cls = self.overrides.get(name, bound.cls)
        recorded = self._recorded_outputs(name)
        is_source = issubclass(cls, SourceStage)
        if is_source:
            inputs: list[tuple[str, Any]] = []
            one_at_a_time = False
            if not any(v is not None for v in recorded.values()):
                return StageResult(stage=name, status="skip", detail="no output recorded")
        else:
            got = self._inputs(name, cls.joins_inputs)
            if isinstance(got, str):
                return StageResult(stage=name, status="skip", detail=got)
            inputs, one_at_a_time = got
            fixed = self._substitute_digests(name, inputs)
            if isinstance(fixed, str):
                return StageResult(stage=name, status="skip", inputs=len(inputs), detail=fixed)
            inputs = fixed
        n_in = sum(1 for _, m in inputs if m is not INPUT_END)
        services = self.services.fresh()
        mailboxes = _RecordingMailboxes()
        if not cls.outputs:  # a sink (deliver): check what it delivers to mailboxes
            services.mailboxes = mailboxes
            mailboxes.open_for(m for _, m in inputs if m is not INPUT_END)
        try:
            stage = cls(bound.params, services)
        except Exception as e:
            return StageResult(stage=name, status="fail", detail=f"failed to build: {e!r}")
        harness = _Harness(name, stage, trace.stage_inputs(name))
        sources = {p: v for p, v in recorded.items() if v is not None}
        error = anyio.run(_run_harness, harness, inputs, one_at_a_time, sources)
        self._emitted[name] = harness.emitted
        n_out = sum(len(v) for v in harness.emitted.values())
        comparer = Comparer(self.atol, self.rtol)
        truncated = trace.manifest.truncated
        compared = 0
        for port, want in recorded.items():
            if want is None:
                continue
            got_list = harness.emitted[port]
            n = len(want) if truncated else max(len(want), len(got_list))
            for i in range(n):
                a = want[i] if i < len(want) else None
                b = got_list[i] if i < len(got_list) else None
                where = (
                    comparer.diff(a, b) if a is not None and b is not None else "(message missing)"
                )
                if where is not None:
                    return StageResult(
                        stage=name,
                        status="fail",
                        inputs=n_in,
                        outputs=n_out,
                        detail=f"port {port!r} message #{i} differs at {where or '(message)'}",
                        difference=Difference(
                            port=port, index=i, path=where, recorded=show(a), replayed=show(b)
                        ),
                    )
                compared += 1
        if error is not None:
            return StageResult(
                stage=name,
                status="fail",
                inputs=n_in,
                outputs=n_out,
                detail=f"raised {type(error).__name__}: {error}",
            )
        if not recorded:
            expected = _expected_deliveries(m for _, m in inputs if m is not INPUT_END)
            for i in range(max(len(expected), len(mailboxes.log))):
                a = expected[i] if i < len(expected) else None
                b = mailboxes.log[i] if i < len(mailboxes.log) else None
                where = comparer.diff(a, b) if a is not None and b is not None else "(missing)"
                if where is not None:
                    return StageResult(
                        stage=name,
                        status="fail",
                        inputs=n_in,
                        outputs=len(mailboxes.log),
                        detail=f"mailbox delivery #{i} differs at {where or '(message)'}",
                        difference=Difference(
                            port="(mailboxes)",
                            index=i,
                            path=where,
                            recorded=show(a),
                            replayed=show(b),
                        ),
                    )
            n_out = len(mailboxes.log)
            detail = (
                f"no output ports; {len(mailboxes.log)} chunks and errors delivered to the "
                f"right mailboxes"
            )
        else:
            detail = f"{compared} messages equal"
            unrecorded = [p for p, v in recorded.items() if v is None]
            if unrecorded:
                detail += f" (port(s) {', '.join(unrecorded)} not recorded)"
        return StageResult(stage=name, status="pass", inputs=n_in, outputs=n_out, detail=detail)


def replay_trace(
    trace_dir: str | Path,
    stage: str | None = None,
    *,
    model: str | Path | None = None,
    services: Any = None,
    stage_overrides: Mapping[str, type[Stage]] | None = None,
    atol: float = ATOL,
    rtol: float = RTOL,
    cache_dir: Path | None = None,
) -> ReplayReport:
    """Replay every stage of a trace (or the one named) and report per stage.

    `model` replaces the recorded model (a directory whose weights must match); `services`
    holding that model are reused for its model and tokenizer (the engine config is the
    trace's); `stage_overrides` swaps a stage class (for testing that replay catches a
    broken stage).
    """
    trace = load_trace(trace_dir)
    services = build_replay_services(trace, resolve_model(trace, model, cache_dir), services)
    replayer = Replayer(trace, services, stage_overrides=stage_overrides, atol=atol, rtol=rtol)
    names = [stage] if stage is not None else replayer.stage_names()
    results = [replayer.replay(n) for n in names]
    return ReplayReport(trace=str(trace_dir), results=results)
