"""The pooling graph (flowllm/engine/pooling.yaml): valid as built, with the per-step
`choices` channel bounded by the loop that pool itself closes; its requests refused where
the model serves another task or the prompt overfills the context; the same vectors with
the engine core in a process of its own; and the core's front ownership of the chunks
that carry the vectors."""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pytest
from embedding_fixtures import build_bert_dir

from flowllm import LLM, SamplingParams
from flowllm.engine import POOLING_GRAPH
from flowllm.engine.ownership import Ownership
from flowllm.graph.spec import GraphSpec
from flowllm.graph.validator import load_graph, validate_graph
from flowllm.mailbox import RequestFailed
from flowllm.messages import Chunk, PoolingParams, TextDeltas, TokenizedRequest
from flowllm.models.bert import BertModel
from flowllm.traces.replay import replay_trace

TEXTS = ["the cat sat on the mat", "paris is the capital of france", "a blue sea"]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bert_dir(tmp_path_factory.mktemp("pool-bert"), max_position_embeddings=32)


@pytest.fixture(scope="module")
def bert(bert_dir: Path) -> LLM:
    return LLM(str(bert_dir), dtype="float32")


def test_the_pooling_graph_is_valid_with_any_choices_capacity(tmp_path: Path) -> None:
    graph = load_graph(POOLING_GRAPH)
    assert set(graph.stages) == {
        "ingest", "validate", "tokenize", "schedule", "execute", "pool", "deliver"
    }  # fmt: skip
    assert graph.placement["pool"] == graph.placement["execute"] == "core"
    # pool returns every step's credit: the choices it reads first lag by the credit bound
    text = POOLING_GRAPH.read_text()
    text = text.replace("to: pool.choices, capacity: 64", "to: pool.choices, capacity: 1")
    small = tmp_path / "pooling.yaml"
    small.write_text(text)
    assert validate_graph(GraphSpec.load(small)).channels["pool.choices"].capacity == 1


def test_an_encoder_runs_whole_prompts_without_a_kv_cache(bert: LLM) -> None:
    services = bert.services
    assert isinstance(services.model, BertModel)
    assert services.kv_caches == []
    assert not services.config.scheduler.enable_chunked_prefill
    assert not services.config.cache.enable_prefix_caching
    assert services.max_model_len == 32


def test_requests_for_another_task_are_refused(bert: LLM, gpt2_tiny_dir: Path) -> None:
    with pytest.raises(RequestFailed, match=r"'embed' task .*: it does not generate text"):
        bert.generate("the cat", SamplingParams(max_tokens=2))
    generator = LLM(str(gpt2_tiny_dir), dtype="float32", max_model_len=64)
    with pytest.raises(RequestFailed, match="served for the 'generate' task: it makes no"):
        generator.embed("the cat")


def test_a_prompt_may_fill_the_context_but_not_more(bert: LLM) -> None:
    fits = " ".join(["cat"] * 30)  # [CLS] + 30 + [SEP] = 32 tokens
    assert len(bert.embed(fits)[0].prompt_token_ids) == 32
    too_long = "maximum context length is 32 tokens. However, you requested 33 tokens"
    with pytest.raises(RequestFailed, match=re.escape(too_long)):
        bert.embed(fits + " cat")
    with pytest.raises(RequestFailed, match="'dimensions'"):
        bert.embed("cat", PoolingParams(dimensions=8))  # not a Matryoshka model


def test_the_core_in_a_child_process_gives_the_same_vectors(bert: LLM, bert_dir: Path) -> None:
    expected = np.array([o.outputs.embedding for o in bert.embed(TEXTS)])
    llm = LLM(str(bert_dir), dtype="float32", multiprocess=True)
    try:
        got = np.array([o.outputs.embedding for o in llm.embed(TEXTS)])
        assert np.array_equal(got, expected)
        scores = [o.outputs.score for o in llm.score(TEXTS[0], TEXTS[1:])]
        assert scores == [o.outputs.score for o in bert.score(TEXTS[0], TEXTS[1:])]
    finally:
        llm.close()


def _chunk(request_id: str) -> Chunk:
    return Chunk(request_id=request_id, index=0, text="", token_ids=(), finish_reason="stop",
                 pooled=b"\0\0\0\0")  # fmt: skip


def test_each_front_gets_the_chunks_of_its_own_requests() -> None:
    owners = Ownership()
    for front, request_id in ((0, "a"), (1, "b"), (0, "c")):
        owners.arrived(
            front,
            TokenizedRequest(request_id=request_id, prompt_token_ids=(1,), params=SamplingParams(),
                             eos_token_ids=(), arrival_time=time.monotonic()),
        )  # fmt: skip
    step = TextDeltas(step_id=3, chunks=(_chunk("a"), _chunk("b"), _chunk("c")))
    parts = dict(owners.route("deliver.in", step))
    assert {front: [c.request_id for c in part.chunks] for front, part in parts.items()} == {  # type: ignore[attr-defined]
        0: ["a", "c"],
        1: ["b"],
    }
    assert len(owners) == 0  # each request's one chunk ended it
    assert owners.route("deliver.in", TextDeltas(step_id=4, chunks=(_chunk("a"),))) == []


def test_a_recorded_pooling_run_replays_stage_by_stage(tmp_path: Path) -> None:
    """A cross-encoder's pairs (token types in execute, scores in pool): every stage's
    outputs from its recorded inputs are the recorded ones."""
    model = build_bert_dir(tmp_path / "rerank", cross_encoder=True)
    llm = LLM(str(model), dtype="float32", trace_dir=tmp_path / "trace")
    assert len(llm.score(TEXTS[0], TEXTS[1:])) == 2
    report = replay_trace(tmp_path / "trace", services=llm.services)
    assert report.ok, report.format()
    assert [r.stage for r in report.results] == [
        "ingest", "validate", "tokenize", "schedule", "execute", "pool", "deliver"
    ]  # fmt: skip
