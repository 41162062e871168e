"""The committed traces (`traces/` at the repository root) and how to record them again.

Every scenario runs the default graph in float32 on the 2-layer random GPT-2 with the
real GPT-2 tokenizer (`tests/model_fixtures.py`, seed 0, rebuilt on demand) — except
`chat`, on the bundled SmolLM2-135M-Instruct — with logits stored as top-8 digests so
each trace stays tens of KB. The messages are deterministic
(greedy, seeded sampling, the engine seed for unseeded sampling); send times and the
receive order of concurrent messages are those of the recording run.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec

from flowllm.config import BUNDLED_MODEL, engine_config
from flowllm.engine.async_engine import AsyncEngine
from flowllm.mailbox import Mailbox, RequestFailed
from flowllm.messages import ChatMessage, GenerateRequest, SamplingParams, StructuredOutputs
from flowllm.traces.manifest import ModelSource, weights_sha256
from flowllm.traces.recorder import TraceRecorder
from flowllm.traces.trace_model import build_model

TINY_GPT2 = ModelSource(
    builder="random-gpt2",
    kwargs={"seed": 0, "n_layer": 2, "n_embd": 64, "n_head": 4},
)
MODEL_NAME = "gpt2-tiny"
DIGEST_K = 8


class ScenarioError(RuntimeError):
    """A scenario did not exercise what it is for (e.g. no preemption happened)."""


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    requests: Callable[[], list[GenerateRequest]]
    settings: dict[str, Any] = field(default_factory=dict)
    bundled: bool = False  # runs the bundled SmolLM2 instead of the tiny GPT-2
    stream: bool = False
    abort_after_first_chunk: tuple[str, ...] = ()
    check: Callable[[AsyncEngine], None] | None = None


def _request(rid: str, prompt: str, **params: Any) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        model=MODEL_NAME,
        params=SamplingParams(**params),
        arrival_time=time.monotonic(),
        prompt=prompt,
    )


def _greedy() -> list[GenerateRequest]:
    return [
        _request("greedy-0", "Hello, my name is", temperature=0.0, max_tokens=8),
        _request("greedy-1", "The capital of France", temperature=0.0, max_tokens=6),
    ]


def _sampled() -> list[GenerateRequest]:
    return [
        _request("seeded-0", "Once upon a time", seed=1234, top_k=5, max_tokens=8),
        _request(
            "seeded-1", "In a hole in the ground", seed=7, top_p=0.9, temperature=0.8, max_tokens=8
        ),
        _request("unseeded-0", "It was a dark night", top_k=20, min_p=0.0, max_tokens=6),
    ]


def _stop() -> list[GenerateRequest]:
    # Seed 11 with top_k=3 on this model samples " silly Shir Metatron~ silly ...": the stop
    # string spans three tokens and ends inside the fifth.
    return [
        _request(
            "stop-0", "The quick brown fox", seed=11, top_k=3, max_tokens=16, stop=("tron~ sil",)
        ),
        _request(
            "stop-1",
            "The quick brown fox",
            seed=11,
            top_k=3,
            max_tokens=16,
            stop=("tron~ sil",),
            include_stop_str_in_output=True,
        ),
    ]


def _n2() -> list[GenerateRequest]:
    return [_request("n2-0", "A list of colours:", n=2, seed=5, top_k=10, max_tokens=6)]


def _stream() -> list[GenerateRequest]:
    return [
        _request(
            "stream-0", "Streaming works like this", temperature=0.0, max_tokens=8, logprobs=2
        ),
        _request(
            "stream-1", "This one is cancelled", temperature=0.0, max_tokens=64, ignore_eos=True
        ),
    ]


def _errors() -> list[GenerateRequest]:
    return [
        _request("bad-top-p", "Hello", top_p=0.0),
        _request("too-long", "word " * 80, max_tokens=8),
        msgspec.structs.replace(_request("bad-model", "Hello"), model="no-such-model"),
        _request("ok-0", "Hello", temperature=0.0, max_tokens=4),
    ]


def _chat() -> list[GenerateRequest]:
    request = GenerateRequest(
        request_id="chat-0",
        model=BUNDLED_MODEL,
        params=SamplingParams(temperature=0.0, max_tokens=8),
        arrival_time=time.monotonic(),
        messages=(
            ChatMessage("system", "You are a helpful assistant."),
            ChatMessage("user", "What is the capital of France?"),
        ),
    )
    return [request]


def _preemption() -> list[GenerateRequest]:
    prompts = ["One two three four five", "Six seven eight nine ten", "Red green blue"]
    return [
        _request(f"preempt-{i}", p, temperature=0.0, max_tokens=16, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]


def _guided() -> list[GenerateRequest]:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
        "required": ["ok", "n"],
    }
    return [
        _request(
            "guided-regex",
            "Code:",
            temperature=0.0,
            max_tokens=12,
            structured_outputs=StructuredOutputs(regex="[a-z]{3}-[0-9]{2}"),
        ),
        _request(
            "guided-choice",
            "Pick one:",
            n=2,
            seed=3,
            max_tokens=8,
            structured_outputs=StructuredOutputs(choice=("red", "green", "blue")),
        ),
        _request(
            "guided-json",
            "As JSON:",
            n=2,
            seed=5,
            max_tokens=16,
            logprobs=1,
            structured_outputs=StructuredOutputs(json=schema),
        ),
    ]


def _check_preempted(engine: AsyncEngine) -> None:
    scheduler = engine.graph.stage("schedule").scheduler  # type: ignore[attr-defined]
    if scheduler.stats.num_preemptions < 1:
        raise ScenarioError("the preemption scenario ran without a preemption")


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("greedy", "two greedy completions", _greedy),
        Scenario(
            "sampled",
            "seeded top_k and top_p/temperature sampling, and one unseeded request",
            _sampled,
        ),
        Scenario("stop", "a stop string, with and without include_stop_str_in_output", _stop),
        Scenario("n2", "one request with n=2 (two choices sharing the prompt)", _n2),
        Scenario(
            "stream",
            "a streamed request with logprobs, and one aborted after its first chunk",
            _stream,
            stream=True,
            abort_after_first_chunk=("stream-1",),
        ),
        Scenario(
            "errors",
            "rejected requests: bad top_p (validate), prompt too long (tokenize), unknown "
            "model (validate); and one that succeeds",
            _errors,
            settings={"max_model_len": 64},
        ),
        Scenario(
            "chat",
            "a chat request through SmolLM2's own template (the bundled model)",
            _chat,
            settings={"max_model_len": 256, "kv_cache_memory": 16 << 20},
            bundled=True,
        ),
        Scenario(
            "preemption",
            "three requests on a KV cache of 8 blocks of 4 tokens: one is preempted",
            _preemption,
            settings={
                "block_size": 4,
                "kv_cache_memory": 8 * 4 * 2 * 2 * 64 * 4,
                "max_model_len": 32,
            },
            check=_check_preempted,
        ),
        Scenario(
            "guided",
            "constrained requests (regex; choice and JSON schema with n=2, the JSON with "
            "logprobs) on a KV "
            "cache of 5 blocks of 4 tokens: one is preempted, and its grammar goes on",
            _guided,
            settings={
                "block_size": 4,
                "kv_cache_memory": 5 * 4 * 2 * 2 * 64 * 4,
                "max_model_len": 20,
            },
            check=_check_preempted,
        ),
    )
}


async def _read(engine: AsyncEngine, box: Mailbox, request_id: str, abort: bool) -> None:
    try:
        async for _chunk in box:
            if abort:
                engine.abort(request_id)
                return
    except RequestFailed:
        pass


async def _drive(engine: AsyncEngine, scenario: Scenario) -> None:
    requests = scenario.requests()
    async with anyio.create_task_group() as tg:
        for request in requests:
            box = await engine.submit_when_admitted(request)
            abort = request.request_id in scenario.abort_after_first_chunk
            tg.start_soon(_read, engine, box, request.request_id, abort)
            if scenario.stream:
                await anyio.sleep(0)


def record_scenario(
    scenario: Scenario, out_dir: Path, model_dir: Path, *, digest_k: int = DIGEST_K
) -> Path:
    """Record one scenario into `out_dir` (replacing what was there)."""
    from flowllm.engine.loading import build_services

    model = BUNDLED_MODEL if scenario.bundled else str(model_dir)
    config = engine_config(
        model,
        served_model_name=BUNDLED_MODEL if scenario.bundled else MODEL_NAME,
        # float32, the bundled model's GGUF weights dequantized: a replay must match the
        # recording on any machine's kernels, which quantized products' int8 activations
        # and bf16 sums do not promise (their rounding differs by instruction set).
        dtype="float32",
        quantization="none",
        **{"kv_cache_memory": 1 << 20, **scenario.settings},
    )
    services = build_services(config)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    recorder = TraceRecorder(
        out_dir,
        digest_k=digest_k,
        model_source=None if scenario.bundled else TINY_GPT2,
        description=scenario.description,
    )

    async def main() -> None:
        async with AsyncEngine.start(services=services, recorder=recorder) as engine:
            await _drive(engine, scenario)
            if scenario.check is not None:
                scenario.check(engine)

    anyio.run(main)
    return out_dir


def record_all(
    out_root: Path,
    names: list[str] | None = None,
    *,
    model_dir: Path | None = None,
    log: Callable[[str], Any] = print,
) -> list[Path]:
    """Record the named scenarios (default: all) under `out_root/<name>`."""
    if model_dir is None:
        model_dir = build_model(TINY_GPT2, None, None)
    log(f"model {model_dir} (weights sha256 {weights_sha256(model_dir)})")
    written = []
    for name in names or list(SCENARIOS):
        scenario = SCENARIOS.get(name)
        if scenario is None:
            raise ScenarioError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
        path = record_scenario(scenario, out_root / name, model_dir)
        size = sum(f.stat().st_size for f in path.iterdir())
        log(f"recorded {name}: {size / 1024:.1f} KiB in {path}")
        written.append(path)
    return written
