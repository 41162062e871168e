"""A recorded trace loaded for reading: manifest, channel entries, spans, and the links
between them (which entry each span handled, in what order each stage received).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from flowllm.graph.validator import ValidGraph
from flowllm.messages import seq_ids_of
from flowllm.traces.codec import Entry, MessageCodec, iter_frames, read_channel
from flowllm.traces.manifest import SPANS_FILE, Manifest, read_manifest
from flowllm.traces.recorder import SpanRecord


@dataclass(frozen=True)
class Handled:
    """A span linked to the channel entry it handled (`channel`/`index` None if unknown)."""

    span: SpanRecord
    channel: str | None
    index: int | None


@dataclass
class Trace:
    directory: Path
    manifest: Manifest
    graph: ValidGraph
    entries: dict[str, list[Entry]]  # recorded channels only, send order
    spans: list[SpanRecord]
    handled: dict[str, list[Handled]] = field(default_factory=dict)  # stage -> in order
    # stage -> (number of spans before it, port): where each input ended among the spans
    closes: dict[str, list[tuple[int, str]]] = field(default_factory=dict)

    @property
    def recorded(self) -> set[str]:
        return set(self.entries)

    def stage_inputs(self, stage: str) -> dict[str, str]:
        """Input port -> channel name for `stage`."""
        bound = self.graph.stages[stage]
        return {
            port: f"{stage}.{port}"
            for port in bound.cls.inputs
            if f"{stage}.{port}" in self.graph.channels  # an optional port may be unwired
        }

    def stage_outputs(self, stage: str) -> dict[str, tuple[str, ...]]:
        """Output port -> the channels it feeds."""
        bound = self.graph.stages[stage]
        return {
            port: tuple(
                name
                for name, spec in self.graph.channels.items()
                if any(p.stage == stage and p.port == port for p in spec.producers)
            )
            for port in bound.cls.outputs
        }


def producer_of(trace: Trace, channel: str, entry: Entry) -> str | None:
    """Which producer of a fan-in channel sent `entry`: the producer whose span was open at
    the send (a stage emits while handling), preferring one about the same request."""
    producers = {p.stage for p in trace.graph.channels[channel].producers}
    if len(producers) == 1:
        return next(iter(producers))
    t = entry.send_time
    open_spans = [
        h.span
        for stage in producers
        for h in trace.handled.get(stage, ())
        if h.span.started <= t <= h.span.started + h.span.duration
    ]
    request_id = getattr(entry.message, "request_id", None)
    same = [s for s in open_spans if request_id is not None and s.request_id == request_id]
    chosen = same or open_spans
    if not chosen:
        return None
    return max(chosen, key=lambda s: s.started).stage


def load_trace(directory: str | Path) -> Trace:
    """Read a trace directory (refusing another schema version)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    graph = manifest.graph()
    codec = MessageCodec()
    entries: dict[str, list[Entry]] = {}
    for name, info in manifest.channels.items():
        path = directory / info.file
        entries[name] = read_channel(path, codec) if path.is_file() else []
    spans: list[SpanRecord] = []
    spans_path = directory / SPANS_FILE
    if spans_path.is_file():
        decoder = msgspec.msgpack.Decoder(SpanRecord)
        spans = [decoder.decode(frame) for frame in iter_frames(spans_path)]
    trace = Trace(directory, manifest, graph, entries, spans)
    trace.handled = _link_spans(trace)
    return trace


def _link_spans(trace: Trace) -> dict[str, list[Handled]]:
    """Match every span to the entry it handled: same object id, on one of the stage's
    input channels, the latest sent before the span began (an id is reused only after its
    object died, which is after the span that handled it)."""
    by_object: dict[int, list[tuple[float, str, int]]] = defaultdict(list)
    for channel, entries in trace.entries.items():
        for index, entry in enumerate(entries):
            by_object[entry.object_id].append((entry.send_time, channel, index))
    handled: dict[str, list[Handled]] = defaultdict(list)
    inputs_of: dict[str, set[str]] = {}
    closes: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for span in trace.spans:
        if span.closed_port is not None:
            closes[span.stage].append((len(handled[span.stage]), span.closed_port))
            continue
        inputs = inputs_of.get(span.stage)
        if inputs is None:
            inputs = inputs_of[span.stage] = (
                set(trace.stage_inputs(span.stage).values())
                if span.stage in trace.graph.stages
                else set()
            )
        best: tuple[float, str, int] | None = None
        for candidate in by_object.get(span.object_id, ()):
            fits = candidate[1] in inputs and candidate[0] <= span.started
            if fits and (best is None or candidate[0] > best[0]):
                best = candidate
        if best is None:
            handled[span.stage].append(Handled(span, None, None))
        else:
            handled[span.stage].append(Handled(span, best[1], best[2]))
    trace.closes = dict(closes)
    return dict(handled)


def message_request_ids(message: Any, seq_requests: dict[int, str]) -> set[str]:
    """The request ids a message concerns (step messages through their sequences)."""
    request_id = getattr(message, "request_id", None)
    if request_id is not None:
        return {request_id}
    inner = getattr(message, "request", None) or getattr(message, "batch", None)
    if inner is not None and inner is not message:
        return message_request_ids(inner, seq_requests)
    found: set[str] = set()
    for start in getattr(message, "started", ()):
        found.add(start.request_id)
    for step_seq_id in seq_ids_of(message) or ():
        rid = seq_requests.get(step_seq_id)
        if rid is not None:
            found.add(rid)
    for chunk in getattr(message, "chunks", ()):
        found.add(chunk.request_id)
    seq_id = getattr(message, "seq_id", None)
    if seq_id is not None and seq_id in seq_requests:
        found.add(seq_requests[seq_id])
    return found


def seq_request_map(trace: Trace) -> dict[int, str]:
    """seq id -> request id, from every recorded `started` list."""
    mapping: dict[int, str] = {}
    for entries in trace.entries.values():
        for entry in entries:
            holder = getattr(entry.message, "batch", entry.message)
            for start in getattr(holder, "started", ()):
                mapping[start.seq_id] = start.request_id
    return mapping
