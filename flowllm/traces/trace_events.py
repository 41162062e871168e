"""Chrome trace-event records of stage spans, shared by a recorded trace's timeline
(flowllm.traces.timeline) and the web page's live timelines (flowllm.ui.timelines): one
track per stage, one complete slice per span. Free of torch and of the trace files, so a
front process builds them without loading either."""

from __future__ import annotations

from typing import Any

PID = 1  # one process: the graph


def stage_tracks(graph_name: str, tids: dict[str, int]) -> list[dict[str, Any]]:
    """The metadata events naming the process and one track (thread) per stage, in order."""
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": PID, "args": {"name": f"flowllm {graph_name}"}}
    ]
    for name, tid in tids.items():
        events.append(
            {"name": "thread_name", "ph": "M", "pid": PID, "tid": tid, "args": {"name": name}}
        )
        events.append(
            {
                "name": "thread_sort_index",
                "ph": "M",
                "pid": PID,
                "tid": tid,
                "args": {"sort_index": tid},
            }
        )
    return events


def span_slice(
    stage: str,
    *,
    kind: str,
    batch_size: int | None,
    ts: float,
    duration: float,
    queue_wait: float,
    request_ids: list[str],
    step_id: int | None,
    tid: int,
    channel: str | None = None,
) -> dict[str, Any]:
    """One span as a complete ("X") trace event on its stage's track; `ts` in µs, the
    durations in seconds; `kind` names the message handled. The web page's request
    timeline reads exactly these events."""
    args: dict[str, Any] = {
        "request_ids": request_ids,
        "queue_wait_us": round(queue_wait * 1e6, 3),
    }
    if step_id is not None:
        args["step_id"] = step_id
    if batch_size is not None:
        args["batch_size"] = batch_size  # 0: a step that only releases seqs
    if channel is not None:
        args["channel"] = channel
    label = f"{kind} step {step_id}" if step_id is not None else f"{kind} {','.join(request_ids)}"
    return {
        "name": label,
        "cat": stage,
        "ph": "X",
        "ts": ts,
        "dur": round(duration * 1e6, 3),
        "pid": PID,
        "tid": tid,
        "args": args,
    }
