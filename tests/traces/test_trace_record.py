"""Recording through the offline API and the CLI: every channel, a subset, a size limit."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from flowllm.cli import main
from flowllm.llm import LLM
from flowllm.messages import GenerateRequest, SamplingParams
from flowllm.traces.codec import iter_frames, read_channel
from flowllm.traces.manifest import SPANS_FILE, read_manifest
from flowllm.traces.recorder import TraceError
from flowllm.traces.replay import replay_trace

PROMPTS = ["Hello there", "A longer prompt about the sea", "One", "Two words"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(gpt2_tiny_dir: Path) -> LLM:
    return LLM(str(gpt2_tiny_dir), dtype="float32", kv_cache_memory=1 << 20)


def _texts(outputs: list) -> list[str]:
    return [o.outputs[0].text for o in outputs]


def test_recording_every_channel(llm: LLM, tmp_path: Path) -> None:
    expected = _texts(llm.generate(PROMPTS, GREEDY))
    traced = LLM(services=llm.services, trace_dir=tmp_path)
    assert _texts(traced.generate(PROMPTS, GREEDY)) == expected
    manifest = read_manifest(tmp_path)
    assert not manifest.truncated
    assert set(manifest.channels) == set(manifest.graph().channels)
    for name, info in manifest.channels.items():
        entries = read_channel(tmp_path / info.file)
        assert len(entries) == info.count, name
        # no stop strings, no errors, no constrained request (so guide gets no batch and
        # no step has masks)
        quiet = ("schedule.finishes", "deliver.errors", "guide.in", "sample.masks")
        assert (info.count == 0) == (name in quiet), name
        times = [e.send_time for e in entries]
        assert times == sorted(times), f"{name} is not in send order"
    requests = read_channel(tmp_path / "validate.in.msgpack")
    assert [e.message.prompt for e in requests] == PROMPTS
    assert (tmp_path / SPANS_FILE).stat().st_size > 0


def test_recording_a_subset_of_channels_replays_what_it_can(llm: LLM, tmp_path: Path) -> None:
    traced = LLM(
        services=llm.services,
        trace_dir=tmp_path,
        trace_channels=["tokenize.in", "schedule.requests"],
    )
    traced.generate(PROMPTS, GREEDY)
    assert sorted(p.name for p in tmp_path.glob("*.msgpack")) == [
        "schedule.requests.msgpack",
        SPANS_FILE,
        "tokenize.in.msgpack",
    ]
    report = replay_trace(tmp_path, model=llm.config.model.model, services=llm.services)
    assert report.ok, report.format()
    status = {r.stage: r.status for r in report.results}
    assert status["tokenize"] == "pass"
    assert status["execute"] == "skip"
    assert "not recorded" in report.result("execute").detail


def test_recording_stops_cleanly_at_max_bytes(llm: LLM, tmp_path: Path) -> None:
    expected = _texts(llm.generate(PROMPTS, GREEDY))
    limit = 30_000
    traced = LLM(services=llm.services, trace_dir=tmp_path, trace_max_bytes=limit)
    assert _texts(traced.generate(PROMPTS, GREEDY)) == expected
    manifest = read_manifest(tmp_path)
    assert manifest.truncated
    assert manifest.stop_reason == f"reached the size limit of {limit} bytes"
    assert manifest.max_bytes == limit
    files = list(tmp_path.glob("*.msgpack"))
    assert sum(f.stat().st_size for f in files) <= limit
    for f in files:  # every file ends on a whole entry
        consumed = sum(4 + len(frame) for frame in iter_frames(f))
        assert consumed == f.stat().st_size
    report = replay_trace(tmp_path, "validate", services=llm.services, model=llm.config.model.model)
    assert report.ok, report.format()


def test_an_unknown_channel_is_refused(llm: LLM, tmp_path: Path) -> None:
    traced = LLM(services=llm.services, trace_dir=tmp_path, trace_channels=["nope.in"])
    with pytest.raises(TraceError, match="unknown trace channel"):
        traced.generate(PROMPTS[:1], GREEDY)


def test_generate_cli_records_with_trace_flags(gpt2_tiny_dir: Path, tmp_path: Path) -> None:
    code = main(
        [
            "generate", str(gpt2_tiny_dir), "--dtype", "float32", "--kv-cache-memory", "1MiB",
            "--max-tokens", "3", "--temperature", "0", "--trace-dir", str(tmp_path),
            "--trace-channels", "validate.in,deliver.in", "--trace-max-bytes", "1MiB", "Hi",
        ]
    )  # fmt: skip
    assert code == 0
    manifest = read_manifest(tmp_path)
    assert set(manifest.channels) == {"validate.in", "deliver.in"}
    assert manifest.max_bytes == 1 << 20
    assert manifest.channels["deliver.in"].count == 3


def test_recording_stops_when_the_writer_falls_behind(llm: LLM, tmp_path: Path) -> None:
    import anyio

    from flowllm.engine.async_engine import AsyncEngine
    from flowllm.traces.recorder import TraceRecorder

    recorder = TraceRecorder(tmp_path, max_backlog=1)

    async def run() -> int:
        async with AsyncEngine.start(services=llm.services.fresh(), recorder=recorder) as engine:
            requests = [
                GenerateRequest(
                    request_id=f"r{i}", model=engine.model_name, params=GREEDY,
                    arrival_time=time.monotonic(), prompt=p,
                )
                for i, p in enumerate(PROMPTS)
            ]  # fmt: skip
            boxes = [engine.submit(r) for r in requests]
            done = 0
            for box in boxes:
                tokens = [t async for chunk in box for t in chunk.token_ids]
                done += len(tokens) == GREEDY.max_tokens
            return done

    assert anyio.run(run) == len(PROMPTS)
    manifest = read_manifest(tmp_path)
    assert manifest.truncated
    assert manifest.stop_reason == "the trace writer fell behind the graph"
