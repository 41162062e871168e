"""examples/graphs/audit.yaml: one valid JSON line per request, written off the event loop."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import openai
import pytest
from example_server import EXAMPLES, MODEL_NAME, load_example_stage_module

from flowllm.messages import Abort, SamplingParams, TokenizedRequest

AUDIT_YAML = EXAMPLES / "graphs" / "audit.yaml"


audit = load_example_stage_module("audit")


def read_lines(path: Path, count: int, timeout: float = 15.0) -> list[dict[str, Any]]:
    """The file's JSON lines once it has `count` of them (the writer runs in the background)."""
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text() if path.exists() else ""
        lines = text.splitlines()
        if len(lines) >= count or time.monotonic() > deadline:
            assert text.endswith("\n") or not text
            return [json.loads(line) for line in lines]
        time.sleep(0.05)


def test_audit_graph_end_to_end(start_server: Any, tmp_path: Path, gpt2_tokenizer: Any) -> None:
    # The shipped file as is: `path: audit.jsonl` lands in the server's working directory.
    before = time.time()
    server = start_server(AUDIT_YAML, cwd=tmp_path)
    client = server.client()
    prompts = ["Hello there", "The story begins", "A much longer prompt, with commas, and more"]
    responses = []
    for i, prompt in enumerate(prompts):
        responses.append(
            client.completions.create(
                model=MODEL_NAME, prompt=prompt, max_tokens=3 + i, temperature=0.5, seed=i
            )
        )
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=[50256, 464, 1110],
        max_tokens=2,
        stream=True,
        extra_body={"top_k": 5},
    )
    stream_events = list(stream)

    async def burst() -> list[Any]:
        async with server.async_client() as aclient:
            return list(
                await asyncio.gather(
                    *(
                        aclient.completions.create(
                            model=MODEL_NAME, prompt=f"Request number {i}", max_tokens=2
                        )
                        for i in range(8)
                    )
                )
            )

    burst_responses = asyncio.run(burst())
    with pytest.raises(openai.BadRequestError):  # refused by validate: never audited
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, temperature=9.0)
    after = time.time()

    lines = read_lines(tmp_path / "audit.jsonl", 3 + 1 + 8)
    assert len(lines) == 12
    by_id = {line["id"]: line for line in lines}
    assert len(by_id) == 12
    for line in lines:
        assert set(line) == {"id", "model", "prompt_tokens", "params", "arrival_time"}
        assert line["model"] == MODEL_NAME
        assert before <= line["arrival_time"] <= after
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        line = by_id[f"{response.id}-0"]  # the graph's id of the request's first prompt
        assert line["prompt_tokens"] == len(gpt2_tokenizer.encode(prompt))
        assert line["prompt_tokens"] == response.usage.prompt_tokens
        params = line["params"]
        assert (params["max_tokens"], params["temperature"], params["seed"]) == (3 + i, 0.5, i)
        assert params["top_p"] == 1.0  # defaults are recorded too
    streamed = by_id[f"{stream_events[0].id}-0"]
    assert streamed["prompt_tokens"] == 3 and streamed["params"]["top_k"] == 5
    for response in burst_responses:
        assert by_id[f"{response.id}-0"]["prompt_tokens"] == response.usage.prompt_tokens
    # arrival order is kept for requests sent one after another
    sequential = [by_id[f"{r.id}-0"]["arrival_time"] for r in responses]
    assert sequential == sorted(sequential)


# -- the stage in process: lines written by a worker thread, cost on the loop ---------------


class _Services:
    served_model_name = "m"


class _Ctx:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    async def emit(self, port: str, message: Any) -> None:
        self.sent.append(message)


class _RecordingFile:
    """Wraps the stage's file to record which thread writes."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.threads: set[int] = set()

    def write(self, data: bytes) -> int:
        self.threads.add(threading.get_ident())
        return int(self.inner.write(data))

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()


def _request(i: int) -> TokenizedRequest:
    return TokenizedRequest(
        request_id=f"r{i}",
        prompt_token_ids=tuple(range(i % 50 + 1)),
        params=SamplingParams(max_tokens=16, temperature=0.7, logit_bias={5: 1.5}),
        eos_token_ids=(0,),
        arrival_time=time.monotonic(),
    )


class _RunCtx(_Ctx):
    """One input port fed from a list, as the runtime's channel would be."""

    def __init__(self, messages: list[Any]) -> None:
        super().__init__()
        self._messages = list(messages)
        self.input_ports = ("in",)

    async def receive_any(self) -> tuple[str, Any]:
        await anyio.lowlevel.checkpoint()
        if not self._messages:
            raise anyio.EndOfStream
        return "in", self._messages.pop(0)

    def handling(self, message: Any, queue_wait: float | None = None) -> nullcontext[None]:
        return nullcontext()


def test_audit_stage_writes_off_the_loop_and_costs_little(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    stage = audit.Audit(audit.AuditParams(path=str(path)), _Services())
    recording = _RecordingFile(stage._file)
    stage._file = recording
    count = 2000
    messages: list[Any] = [_request(i) for i in range(count)]
    messages.insert(10, Abort("r3"))
    ctx = _RunCtx(messages)
    timings: list[float] = []
    handle = stage.handle

    async def timed_handle(message: Any, ctx: Any) -> None:
        started = time.perf_counter()
        await handle(message, ctx)
        timings.append(time.perf_counter() - started)

    stage.handle = timed_handle
    loop_thread = threading.get_ident()
    anyio.run(stage.run, ctx)

    assert ctx.sent == messages  # forwarded unchanged, in order, aborts included
    assert loop_thread not in recording.threads  # the loop never touched the file
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["id"] for line in lines] == [f"r{i}" for i in range(count)]
    assert lines[7]["prompt_tokens"] == 8
    assert lines[7]["params"]["logit_bias"] == {"5": 1.5}
    mean_us = sum(timings) / len(timings) * 1e6
    # Tens of microseconds on a quiet machine; the bound leaves room for a busy one.
    print(f"audit: {mean_us:.1f} µs per request on the event loop (mean of {count})")
    assert mean_us < 1000, f"audit costs {mean_us:.0f} µs per request on the loop"


def test_audit_buffer_bound_waits_for_the_writer(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    stage = audit.Audit(audit.AuditParams(path=str(path), max_buffered=2), _Services())
    ctx = _RunCtx([_request(i) for i in range(50)])
    anyio.run(stage.run, ctx)
    assert len(path.read_text().splitlines()) == 50


def test_audit_params_are_checked() -> None:
    from flowllm.graph.problems import GraphValidationError
    from flowllm.graph.spec import GraphSpec
    from flowllm.graph.validator import validate_graph

    text = AUDIT_YAML.read_text().replace("with: {path: audit.jsonl}", "with: {}")
    with pytest.raises(GraphValidationError, match=r"missing required param 'path' \(str\)"):
        validate_graph(GraphSpec.from_yaml(text, base_dir=AUDIT_YAML.parent))
