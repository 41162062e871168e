"""A trace as a timeline: Chrome trace-event JSON for Perfetto, and a per-request summary.

Timeline: one track per stage with a slice per span (the message it handled, its request
and step ids, its queue wait), a counter per recorded channel with its depth (sends minus
receives), and per request an async slice from its arrival to its last span.

Summary: for each request, its end-to-end time split along its critical path. Starting
from the last span that served it (deliver delivering its final chunk, or its error), walk
back: a span's stage gets the time from the span's start to the send of the message that
continued the request's path; the message's channel gets its queue wait; the message's
producer is the producer span about the same request that was open (or last began) when
it was sent. The walk ends at the request's arrival, so the parts add up to the
end-to-end latency; time the walk cannot place is shown as `unattributed`.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowllm.graph.spans import message_fields
from flowllm.graph.stage import SourceStage
from flowllm.traces.trace import Handled, Trace, seq_request_map
from flowllm.traces.trace_events import PID, span_slice, stage_tracks


@dataclass
class RequestSummary:
    request_id: str
    start: float  # perf_counter seconds: the request's first send (ingest)
    end: float  # the end of the last span that served it
    stages: dict[str, float] = field(default_factory=dict)  # seconds per stage
    waits: dict[str, float] = field(default_factory=dict)  # seconds per channel
    unattributed: float = 0.0

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def accounted(self) -> float:
        return sum(self.stages.values()) + sum(self.waits.values())


class _Index:
    """Which requests each span concerns, and where each request starts and ends."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.seq_requests = seq_request_map(trace)
        self.step_requests: dict[int, set[str]] = defaultdict(set)
        for entries in trace.entries.values():
            for entry in entries:
                batch = getattr(entry.message, "batch", entry.message)
                rows = getattr(batch, "rows", None)
                step_id = getattr(batch, "step_id", None)
                if rows is None or step_id is None:
                    continue
                for seq_id in rows.seq_ids:
                    rid = self.seq_requests.get(seq_id)
                    if rid is not None:
                        self.step_requests[step_id].add(rid)
        self.spans: list[tuple[Handled, frozenset[str]]] = []
        for stage, handled in trace.handled.items():
            del stage
            for h in handled:
                self.spans.append((h, frozenset(self.requests_of(h))))
        self.first_send: dict[str, float] = {}
        for entries in trace.entries.values():
            for entry in entries:
                for rid in self.message_requests(entry.message):
                    t = self.first_send.get(rid)
                    if t is None or entry.send_time < t:
                        self.first_send[rid] = entry.send_time

    def message_requests(self, message: Any) -> set[str]:
        rid = getattr(message, "request_id", None)
        if rid is not None:
            return {rid}
        inner = getattr(message, "request", None)
        if inner is not None:
            return {inner.request_id}
        chunks = getattr(message, "chunks", None)
        if chunks is not None:
            return {c.request_id for c in chunks}
        batch = getattr(message, "batch", message)
        step_id = getattr(batch, "step_id", None)
        if step_id is not None:
            found = set(self.step_requests.get(step_id, ()))
            found.update(s.request_id for s in getattr(batch, "started", ()))
            return found
        seq_id = getattr(message, "seq_id", None)
        if seq_id is not None and seq_id in self.seq_requests:
            return {self.seq_requests[seq_id]}
        return set()

    def requests_of(self, h: Handled) -> set[str]:
        if h.channel is not None and h.index is not None:
            return self.message_requests(self.trace.entries[h.channel][h.index].message)
        if h.span.request_id is not None:
            return {h.span.request_id}
        if h.span.step_id is not None:
            return set(self.step_requests.get(h.span.step_id, ()))
        return set()


def _end(h: Handled) -> float:
    return h.span.started + h.span.duration


def summarize(trace: Trace) -> list[RequestSummary]:
    """Each request's end-to-end time split over stages and channel waits."""
    index = _Index(trace)
    by_request: dict[str, list[Handled]] = defaultdict(list)
    for h, rids in index.spans:
        for rid in rids:
            by_request[rid].append(h)
    graph = trace.graph
    terminal = {name for name, b in graph.stages.items() if not b.cls.outputs}
    sources = {name for name, b in graph.stages.items() if issubclass(b.cls, SourceStage)}
    summaries = []
    for rid, spans in by_request.items():
        start = index.first_send.get(rid, min(h.span.started for h in spans))
        finals = [h for h in spans if h.span.stage in terminal] or spans
        last = max(finals, key=_end)
        summary = RequestSummary(rid, start, max(_end(h) for h in spans))
        stages: dict[str, float] = defaultdict(float)
        waits: dict[str, float] = defaultdict(float)
        # Time after the final delivery (schedule still freeing the request's blocks).
        tail = summary.end - _end(last)
        if tail > 0:
            stages[_latest_stage_after(spans, _end(last))] += tail
        cur, t_out = last, _end(last)
        chain_start = cur.span.started
        for _ in range(100_000):
            stages[cur.span.stage] += t_out - cur.span.started
            chain_start = cur.span.started
            if cur.channel is None or cur.index is None:
                break
            sent = trace.entries[cur.channel][cur.index].send_time
            waits[cur.channel] += cur.span.started - sent
            chain_start = sent
            producers = {p.stage for p in graph.channels[cur.channel].producers}
            if producers & sources:
                break
            candidates = [
                h
                for h in spans
                if h.span.stage in producers and h.span.started <= sent and h is not cur
            ]
            if not candidates:
                break
            cur, t_out = max(candidates, key=lambda h: h.span.started), sent
        summary.unattributed = max(0.0, chain_start - start)
        summary.stages = dict(stages)
        summary.waits = dict(waits)
        summaries.append(summary)
    summaries.sort(key=lambda s: s.start)
    return summaries


def _latest_stage_after(spans: list[Handled], t: float) -> str:
    after = [h for h in spans if _end(h) > t]
    return max(after, key=_end).span.stage


def format_summary(trace: Trace, summaries: list[RequestSummary], per_block: int = 6) -> str:
    """The "Complete Timeline Summary" table, measured: milliseconds per request."""
    stages = list(trace.graph.stages)
    channels = sorted({c for s in summaries for c in s.waits})
    rows = [(name, "stage") for name in stages] + [(c, "wait") for c in channels]
    out: list[str] = []
    for first in range(0, len(summaries), per_block):
        block = summaries[first : first + per_block]
        head = f"{'ms':<28}" + "".join(f"{s.request_id[:13]:>14}" for s in block)
        out += [head, "-" * len(head)]
        for name, kind in rows:
            values = [(s.stages if kind == "stage" else s.waits).get(name, 0.0) for s in block]
            label = name if kind == "stage" else f"  wait {name}"
            out.append(f"{label:<28}" + "".join(f"{v * 1e3:>14.3f}" for v in values))
        out.append(
            f"{'  unattributed':<28}" + "".join(f"{s.unattributed * 1e3:>14.3f}" for s in block)
        )
        out.append(
            f"{'sum':<28}"
            + "".join(f"{(s.accounted + s.unattributed) * 1e3:>14.3f}" for s in block)
        )
        out.append(f"{'end-to-end':<28}" + "".join(f"{s.e2e * 1e3:>14.3f}" for s in block))
        out.append("")
    return "\n".join(out)


def chrome_trace(trace: Trace) -> dict[str, Any]:
    """Chrome trace-event JSON (the object form), times in µs from the trace's start."""
    index = _Index(trace)
    times = [h.span.started for h, _ in index.spans]
    times += [e.send_time for es in trace.entries.values() for e in es]
    t0 = min(times) if times else 0.0

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 3)

    pid = PID
    tids = {name: i + 1 for i, name in enumerate(trace.graph.stages)}
    events = stage_tracks(trace.graph.name, tids)
    receives: dict[str, list[float]] = defaultdict(list)
    for h, rids in index.spans:
        span = h.span
        message = (
            trace.entries[h.channel][h.index].message if h.channel and h.index is not None else None
        )
        step_id = span.step_id
        if step_id is None and message is not None:
            step_id = getattr(getattr(message, "batch", message), "step_id", None)
        if h.channel is not None:
            receives[h.channel].append(span.started)
        events.append(
            span_slice(
                span.stage,
                kind=type(message).__name__ if message is not None else "message",
                batch_size=(
                    message_fields(message).get("batch_size") if message is not None else None
                ),
                ts=us(span.started),
                duration=span.duration,
                queue_wait=span.queue_wait,
                request_ids=sorted(rids),
                step_id=step_id,
                tid=tids.get(span.stage, 0),
                channel=h.channel,
            )
        )
    for channel, entries in trace.entries.items():
        changes = [(e.send_time, 1) for e in entries] + [(t, -1) for t in receives.get(channel, ())]
        changes.sort()
        depth = 0
        for t, delta in changes:
            depth += delta
            events.append(
                {
                    "name": f"depth {channel}",
                    "ph": "C",
                    "ts": us(t),
                    "pid": pid,
                    "args": {"depth": max(depth, 0)},
                }
            )
    for number, summary in enumerate(summarize(trace)):
        common = {
            "name": f"request {summary.request_id}",
            "cat": "request",
            "id": number + 1,
            "pid": pid,
        }
        events.append(
            {
                **common,
                "ph": "b",
                "ts": us(summary.start),
                "args": {"request_id": summary.request_id},
            }
        )
        events.append({**common, "ph": "e", "ts": us(summary.end)})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"trace": str(trace.directory), "graph": trace.graph.name},
    }


def write_chrome_trace(trace: Trace, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(trace)))
    return path
