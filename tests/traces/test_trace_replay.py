"""Stage-level replay of every committed trace, and replay catching subtly broken stages."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest

from flowllm.cli import main
from flowllm.config import engine_config
from flowllm.engine.loading import build_services
from flowllm.messages import GenerateRequest, TextDeltas
from flowllm.stages.deliver import Deliver
from flowllm.stages.execute import Execute
from flowllm.stages.guide import Guide
from flowllm.stages.sample import Sample
from flowllm.stages.services import EngineServices
from flowllm.stages.tokenize import Tokenize
from flowllm.traces.manifest import ModelSource, read_manifest
from flowllm.traces.replay import replay_trace
from flowllm.traces.trace_model import TraceModelError, build_model

REPO = Path(__file__).resolve().parents[2]
TRACES = sorted(d.name for d in (REPO / "traces").iterdir() if d.is_dir())
STAGES = [
    "ingest", "validate", "tokenize", "schedule", "execute", "guide", "sample", "detokenize",
    "deliver",
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_services(gpt2_tiny_dir: Path) -> EngineServices:
    """The tiny GPT-2 loaded once; each replay reuses its model and tokenizer."""
    return build_services(
        engine_config(str(gpt2_tiny_dir), dtype="float32", kv_cache_memory=1 << 20)
    )


def test_the_committed_traces_cover_the_scenarios() -> None:
    assert set(TRACES) >= {
        "greedy", "sampled", "stop", "n2", "stream", "errors", "preemption", "chat", "guided"
    }  # fmt: skip
    for name in TRACES:
        size = sum(f.stat().st_size for f in (REPO / "traces" / name).iterdir())
        assert size < 100 * 1024, f"trace {name} is {size} bytes"


BUNDLED_TRACES = ("chat",)  # recorded on the bundled SmolLM2, found by its name


@pytest.mark.parametrize("name", TRACES)
def test_every_stage_replays_every_committed_trace(
    name: str, gpt2_tiny_dir: Path, tiny_services: EngineServices, request: pytest.FixtureRequest
) -> None:
    if name in BUNDLED_TRACES:
        request.getfixturevalue("flowllm_cache_with_smollm2")
        report = replay_trace(REPO / "traces" / name)
    else:
        report = replay_trace(REPO / "traces" / name, model=gpt2_tiny_dir, services=tiny_services)
    assert report.ok, report.format()
    assert [r.stage for r in report.results] == STAGES
    for result in report.results:
        assert result.status == "pass", report.format()
        if result.stage not in ("ingest", "deliver"):
            assert result.inputs > 0, report.format()
            # guide sends masks only for steps with a constrained sampling row
            if result.stage != "guide" or name == "guided":
                assert result.outputs > 0, report.format()


def test_committed_traces_exercise_what_they_are_named_for() -> None:
    from flowllm.traces.trace import load_trace

    def chunks(name: str) -> list[Any]:
        trace = load_trace(REPO / "traces" / name)
        return [c for e in trace.entries["deliver.in"] for c in e.message.chunks]

    assert "".join(c.text for c in chunks("chat")) == "The capital of France is Paris."
    stops = [c for c in chunks("stop") if c.finish_reason == "stop"]
    assert {c.stop_reason for c in stops} == {"tron~ sil"}
    assert {c.index for c in chunks("n2")} == {0, 1}
    errors = load_trace(REPO / "traces" / "errors").entries["deliver.errors"]
    assert {e.message.request_id for e in errors} == {"bad-top-p", "too-long", "bad-model"}
    stream = load_trace(REPO / "traces" / "stream").entries["schedule.requests"]
    assert any(type(e.message).__name__ == "Abort" for e in stream)
    preemption = load_trace(REPO / "traces" / "preemption")
    # A preempted sequence is computed again from its first token: a second prefill.
    prefills: dict[int, int] = {}
    for entry in preemption.entries["execute.in"]:
        for seq in entry.message.rows:
            if seq.num_computed_tokens == 0:
                prefills[seq.seq_id] = prefills.get(seq.seq_id, 0) + 1
    assert max(prefills.values()) >= 2


def test_the_guided_trace_keeps_its_constraints_through_a_preemption() -> None:
    from flowllm.traces.trace import load_trace

    trace = load_trace(REPO / "traces" / "guided")
    texts: dict[tuple[str, int], str] = {}
    finish: dict[tuple[str, int], str | None] = {}
    for entry in trace.entries["deliver.in"]:
        for c in entry.message.chunks:
            texts[c.request_id, c.index] = texts.get((c.request_id, c.index), "") + c.text
            finish[c.request_id, c.index] = c.finish_reason
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", texts["guided-regex", 0])
    assert finish["guided-regex", 0] == "stop"  # the grammar ended: only EOS was allowed
    assert {texts["guided-choice", i] for i in (0, 1)} <= {"red", "green", "blue"}
    for i in (0, 1):  # cut by max_tokens, but a prefix of the schema's JSON
        assert re.match(r'\{"ok": (true|false), "n": -?[0-9]', texts["guided-json", i])
    prefills: dict[int, int] = {}
    for entry in trace.entries["guide.in"]:
        for seq in entry.message.rows:
            if seq.num_computed_tokens == 0:
                prefills[seq.seq_id] = prefills.get(seq.seq_id, 0) + 1
    assert max(prefills.values()) >= 2  # a constrained sequence was recomputed


class GrammarBlindGuide(Guide):
    """A guide that allows every token: its grammar is forgotten."""

    def _fill(self, batch: Any) -> Any:
        masks = super()._fill(batch)
        if masks.bitmask is not None:
            masks.bitmask.fill_(-1)
        return masks


def test_a_guide_forgetting_the_grammar_fails_replay(
    gpt2_tiny_dir: Path, tiny_services: EngineServices
) -> None:
    report = replay_trace(
        REPO / "traces" / "guided",
        "guide",
        model=gpt2_tiny_dir,
        services=tiny_services,
        stage_overrides={"guide": GrammarBlindGuide},
    )
    result = report.result("guide")
    assert result.status == "fail", report.format()
    assert result.difference is not None and ".bitmask" in result.difference.path


class DroppingTokenize(Tokenize):
    """A tokenizer that loses the last token of every prompt."""

    def prompt_token_ids(self, request: GenerateRequest) -> tuple[int, ...]:
        ids = super().prompt_token_ids(request)
        return ids[:-1] if len(ids) > 1 else ids


class TopKBlindSample(Sample):
    """A sampler that ignores top_k."""

    def __init__(self, params: Any, services: EngineServices) -> None:
        super().__init__(params, services)
        start = self.sampler.start

        def start_without_top_k(seq: Any) -> None:
            start(msgspec.structs.replace(seq, params=msgspec.structs.replace(seq.params, top_k=0)))

        self.sampler.start = start_without_top_k  # type: ignore[method-assign]


def test_a_tokenizer_dropping_a_token_fails_replay(
    gpt2_tiny_dir: Path, tiny_services: EngineServices
) -> None:
    report = replay_trace(
        REPO / "traces" / "greedy",
        model=gpt2_tiny_dir,
        services=tiny_services,
        stage_overrides={"tokenize": DroppingTokenize},
    )
    assert not report.ok
    failed = [r.stage for r in report.results if r.status == "fail"]
    assert failed == ["tokenize"]
    diff = report.result("tokenize").difference
    assert diff is not None
    assert (diff.port, diff.index) == ("out", 0)
    assert diff.path.startswith(".prompt_token_ids")
    text = report.format()
    assert "tokenize     FAIL" in text
    assert "tokenize: first difference on port 'out', message #0" in text
    assert "recorded" in text and "replayed" in text


def test_a_sampler_ignoring_top_k_fails_replay(
    gpt2_tiny_dir: Path, tiny_services: EngineServices
) -> None:
    report = replay_trace(
        REPO / "traces" / "sampled",
        "sample",
        model=gpt2_tiny_dir,
        services=tiny_services,
        stage_overrides={"sample": TopKBlindSample},
    )
    result = report.result("sample")
    assert result.status == "fail"
    assert result.difference is not None
    assert result.difference.port == "out"
    assert result.difference.path.startswith(".sampled.token_ids"), result.difference.path
    assert "sample: first difference on port 'out'" in report.format()


class OffExecute(Execute):
    """A model step whose logits are off by 1e-3 (a kernel with a small numeric bug)."""

    def __init__(self, params: Any, services: Any) -> None:
        super().__init__(params, services)
        run = self.runner.run

        def shifted(*args: Any) -> Any:
            logits, prompt = run(*args)
            return logits + 1e-3, prompt

        self.runner.run = shifted  # type: ignore[method-assign]


@pytest.mark.parametrize("name", ["greedy", "preemption"])
def test_logits_off_by_more_than_the_tolerance_fail_replay(
    name: str, gpt2_tiny_dir: Path, tiny_services: EngineServices
) -> None:
    report = replay_trace(
        REPO / "traces" / name,
        "execute",
        model=gpt2_tiny_dir,
        services=tiny_services,
        stage_overrides={"execute": OffExecute},
    )
    result = report.result("execute")
    assert result.status == "fail", report.format()
    assert result.difference is not None and ".logits" in result.difference.path
    assert "digest" in result.difference.recorded


class MisroutingDeliver(Deliver):
    """A deliver stage that puts a request's chunks to the mailbox of choice 0 always."""

    async def handle(self, message: Any, ctx: Any) -> None:
        if isinstance(message, TextDeltas):
            message = TextDeltas(
                step_id=message.step_id,
                chunks=tuple(msgspec.structs.replace(c, index=0) for c in message.chunks),
            )
        await super().handle(message, ctx)


def test_a_format_misrouting_choices_fails_replay(
    gpt2_tiny_dir: Path, tiny_services: EngineServices
) -> None:
    report = replay_trace(
        REPO / "traces" / "n2",
        "deliver",
        model=gpt2_tiny_dir,
        services=tiny_services,
        stage_overrides={"deliver": MisroutingDeliver},
    )
    result = report.result("deliver")
    assert result.status == "fail", report.format()
    assert result.difference is not None and result.difference.port == "(mailboxes)"


def test_replay_refuses_a_model_with_other_weights(tmp_path: Path, gpt2_tiny_dir: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(gpt2_tiny_dir, other)
    (other / "model.safetensors").write_bytes(b"not the weights")
    with pytest.raises(TraceModelError, match="weights sha256"):
        replay_trace(REPO / "traces" / "greedy", model=other)


def test_the_cli_replays_a_stage_and_refuses_another_schema(
    tmp_path: Path, gpt2_tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = REPO / "traces" / "errors"
    code = main(
        ["trace", "replay", str(trace), "--stage", "validate", "--model", str(gpt2_tiny_dir)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "validate     PASS" in out
    copy = tmp_path / "old"
    shutil.copytree(trace, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["schema_version"] = 0
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert main(["trace", "replay", str(copy)]) == 2
    assert "schema version 0" in capsys.readouterr().err


def test_the_manifest_names_how_to_rebuild_the_model() -> None:
    manifest = read_manifest(REPO / "traces" / "greedy")
    assert manifest.model.source is not None
    assert manifest.model.source.builder == "random-gpt2"
    assert manifest.model.source.kwargs == {"seed": 0, "n_layer": 2, "n_embd": 64, "n_head": 4}
    assert manifest.dtype == "float32"
    assert manifest.digest_k > 0
    assert manifest.model.weights_sha256 is not None


@pytest.mark.parametrize("builder", ["model_fixtures:build_gpt2_dir", "os:system"])
def test_a_trace_cannot_name_code_to_run(builder: str, tmp_path: Path) -> None:
    """Replay rebuilds a trace's model only with a builder it knows by name: a trace file
    naming a module and function is refused, nothing imported."""
    source = ModelSource(builder=builder, kwargs={"command": "touch pwned"})
    with pytest.raises(TraceModelError, match="unknown builder"):
        build_model(source, None, tmp_path)
    assert not any(tmp_path.rglob("*pwned*"))


def test_floats_compare_within_the_tensor_tolerance() -> None:
    """Logprobs come from logits this machine's kernels may sum in another order: they
    match within atol + rtol * |recorded|, infinities and NaNs only themselves."""
    from flowllm.traces.compare import Comparer

    diff = Comparer(atol=1e-4, rtol=1e-4).diff
    assert diff(-2.5, -2.5 + 2e-4) is None
    assert diff(-2.5, -2.5 + 1e-3) == ""
    assert diff(float("-inf"), float("-inf")) is None
    assert diff(float("-inf"), -1e30) == ""
    assert diff(float("nan"), float("nan")) is None
    assert diff(float("nan"), 0.0) == ""
    assert diff((1, 2.0), (1, 2.0 + 1e-6), "x") is None
    assert diff((1, 2.0), (2, 2.0), "x") == "x[0]"  # ints stay exact
