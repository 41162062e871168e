"""The timeline of a 16-request run: valid trace-event JSON, and a summary that adds up."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from flowllm.cli import main
from flowllm.llm import LLM
from flowllm.messages import SamplingParams
from flowllm.traces.timeline import chrome_trace, summarize
from flowllm.traces.trace import load_trace

PHASES = {"M", "X", "C", "b", "e"}


@pytest.fixture(scope="module")
def run_16(gpt2_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A recorded run of 16 requests of different lengths, greedy and sampled."""
    trace_dir = tmp_path_factory.mktemp("trace-16")
    llm = LLM(
        str(gpt2_tiny_dir),
        dtype="float32",
        kv_cache_memory=1 << 20,
        max_num_seqs=8,
        trace_dir=trace_dir,
    )
    prompts = [f"Request number {i} says" + " more" * (i % 5) for i in range(16)]
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=4 + i % 7, ignore_eos=True
        )
        for i in range(16)
    ]
    outputs = llm.generate(prompts, params)
    assert len(outputs) == 16
    return trace_dir


def test_timeline_is_valid_trace_event_json(run_16: Path, tmp_path: Path) -> None:
    out = tmp_path / "timeline.json"
    assert main(["trace", "view", str(run_16), "-o", str(out)]) == 0
    data = json.loads(out.read_text())
    events = data["traceEvents"]
    assert events
    for e in events:
        assert e["ph"] in PHASES
        assert isinstance(e["pid"], int)
        assert isinstance(e["name"], str)
        if e["ph"] in ("X", "C", "b", "e"):
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0 and isinstance(e["tid"], int)
    trace = load_trace(run_16)
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert set(tracks.values()) == set(trace.graph.stages)
    sliced = {tracks[e["tid"]] for e in events if e["ph"] == "X"}
    # Every stage that handles messages has slices on its own track (ingest is a source;
    # guide gets no batch without a constrained request).
    assert sliced == set(trace.graph.stages) - {"ingest", "guide"}
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert {f"depth {c}" for c in trace.entries if trace.entries[c]} == counters
    assert all(e["args"]["depth"] >= 0 for e in events if e["ph"] == "C")

    lifetimes: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e["ph"] in ("b", "e"):
            rid = e["name"].removeprefix("request ")
            lifetimes[rid].append(e["ts"])
    assert len(lifetimes) == 16
    for rid, (begin, end) in lifetimes.items():
        assert begin <= end, rid
    eps = 0.01  # µs: rounding of ts and dur
    step_slices = 0
    for e in events:
        if e["ph"] != "X":
            continue
        # Every slice serves some request, except steps that only release sequences.
        assert e["args"]["request_ids"] or e["args"].get("batch_size") == 0, e
        for rid in e["args"]["request_ids"]:
            begin, end = lifetimes[rid]
            assert begin - eps <= e["ts"] and e["ts"] + e["dur"] <= end + eps, (rid, e)
        step_slices += "step_id" in e["args"]
    assert step_slices > 0


def test_summary_adds_up_to_each_requests_latency(run_16: Path) -> None:
    trace = load_trace(run_16)
    summaries = summarize(trace)
    assert len(summaries) == 16
    for s in summaries:
        assert s.e2e > 0
        assert abs(s.accounted + s.unattributed - s.e2e) <= 0.05 * s.e2e, s
        assert s.unattributed <= 0.05 * s.e2e, s
        for stage in ("validate", "tokenize", "schedule", "execute", "sample", "detokenize"):
            assert s.stages.get(stage, 0.0) > 0, (stage, s)
        assert s.stages.get("deliver", 0.0) > 0
        assert all(v >= 0 for v in (*s.stages.values(), *s.waits.values())), s
    # Independent of the walk: a request's lifetime covers every step that computed it.
    steps = {e.message.step_id: e.send_time for e in trace.entries["execute.in"]}
    seq_of = {}
    for entry in trace.entries["execute.in"]:
        for start in entry.message.started:
            seq_of[start.seq_id] = start.request_id
    by_id = {s.request_id: s for s in summaries}
    for entry in trace.entries["execute.in"]:
        for seq in entry.message.rows:
            s = by_id[seq_of[seq.seq_id]]
            assert s.start <= steps[entry.message.step_id] <= s.end


def test_view_summary_prints_the_table(run_16: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "view", str(run_16), "--summary"]) == 0
    out = capsys.readouterr().out
    assert "end-to-end" in out and "wait execute.in" in out
    assert "offline-" in out


def test_chrome_trace_of_a_committed_trace(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    data = chrome_trace(load_trace(repo / "traces" / "errors"))
    names = {e["name"] for e in data["traceEvents"] if e["ph"] == "b"}
    assert names == {"request bad-top-p", "request too-long", "request bad-model", "request ok-0"}
