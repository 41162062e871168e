"""examples/graphs/async-scheduling.yaml at load time and execute without its ids edge: the
execute -> sample -> execute cycle takes the step loop's credit bound, `sample.ids` is an
optional output, and a batch that reads ids nobody sends fails with a clear error; sample
sends a step's ids before it waits for them on the host."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from server_process import REPO

from flowllm import LLM
from flowllm.graph.problems import GraphValidationError
from flowllm.graph.spec import GraphSpec
from flowllm.graph.stage import NoParams
from flowllm.graph.validator import validate_graph
from flowllm.messages import (
    PLACEHOLDER_TOKEN,
    SampledToken,
    SamplingParams,
    ScheduledRows,
    ScheduledSeq,
    SeqStart,
    StepBatch,
    StepLogits,
)
from flowllm.sampling.sampler import Chosen
from flowllm.stages.execute import Execute, MissingSampledIdsError
from flowllm.stages.sample import Sample

ASYNC_GRAPH = REPO / "examples" / "graphs" / "async-scheduling.yaml"
IDS_EDGE = "  - {from: sample.ids, to: execute.sampled, capacity: 2}\n"


def validate(text: str) -> None:
    validate_graph(GraphSpec.from_yaml(text, source="g.yaml", base_dir=ASYNC_GRAPH.parent))


def test_the_ids_channel_needs_the_step_loops_credit_bound() -> None:
    text = ASYNC_GRAPH.read_text()
    assert IDS_EDGE in text
    validate(text)
    with pytest.raises(GraphValidationError) as info:
        validate(text.replace(IDS_EDGE, IDS_EDGE.replace("capacity: 2", "capacity: 1")))
    (problem,) = info.value.problems
    assert "cycle execute -> sample -> execute: channel 'execute.sampled' has capacity 1, " \
        "below the credit bound 2 of stage 'schedule'" in str(problem)  # fmt: skip


def test_without_the_ids_edge_the_graph_is_valid_and_execute_says_what_is_missing(
    gpt2_tiny_dir: Path,
) -> None:
    validate(ASYNC_GRAPH.read_text().replace(IDS_EDGE, ""))  # both ports are optional
    llm = LLM(str(gpt2_tiny_dir), dtype="float32", max_model_len=64)
    execute = Execute(NoParams(), llm.services)
    row = ScheduledSeq(seq_id=0, token_ids=(PLACEHOLDER_TOKEN,), num_computed_tokens=3,
                       block_table=(0,), sample=True, num_output_tokens=1,
                       input_from=(4, 0))  # fmt: skip
    batch = StepBatch(step_id=5, rows=ScheduledRows.of((row,)), reads_sampled=(4,), inflight_from=4)
    with pytest.raises(MissingSampledIdsError, match=r"connect sample\.ids to execute\.sampled"):
        asyncio.run(execute.handle(batch, None))  # type: ignore[arg-type]


class _Recorder:
    """Stands in for sample's context: records what it emits, in order, with the sampler's
    host copies (`finish`) among them."""

    def __init__(self, ports: set[str]) -> None:
        self.output_ports = ports
        self.events: list[str] = []

    async def emit(self, port: str, message: object) -> None:
        self.events.append(port)


@pytest.mark.parametrize("ports", [{"out", "ids"}, {"out"}])
def test_sample_sends_a_steps_ids_before_it_copies_them_to_the_host(
    gpt2_tiny_dir: Path, ports: set[str]
) -> None:
    """Connected to execute, sample sends the ids it chose on the device before the host
    waits for them (`Sampler.finish`), so the next step can run meanwhile; unconnected, it
    sends only the tokens."""
    llm = LLM(str(gpt2_tiny_dir), dtype="float32", max_model_len=64)
    sample = Sample(NoParams(), llm.services)
    ctx = _Recorder(ports)
    finish = sample.sampler.finish

    def recorded_finish(chosen: Chosen) -> list[SampledToken]:
        ctx.events.append("finish")
        return finish(chosen)

    sample.sampler.finish = recorded_finish  # type: ignore[method-assign]
    start = SeqStart(seq_id=0, request_id="r", index=0, params=SamplingParams(temperature=0.0),
                     prompt_token_ids=(1, 2), eos_token_ids=(50256,))  # fmt: skip
    row = ScheduledSeq(seq_id=0, token_ids=(1, 2), num_computed_tokens=0, block_table=(0,),
                       sample=True, num_output_tokens=0)  # fmt: skip
    logits = torch.zeros(1, 64)
    logits[0, 7] = 1.0
    step = StepLogits(
        batch=StepBatch(step_id=0, rows=ScheduledRows.of((row,)), started=(start,)), logits=logits
    )
    asyncio.run(sample.sample_step(step, None, ctx))  # type: ignore[arg-type]
    assert ctx.events == (["ids", "finish", "out"] if "ids" in ports else ["finish", "out"])
