"""Speculative decoding with a draft model (method draft_model) through the whole engine.

Greedy and seeded outputs equal the default graph's token for token, over prompts of many
lengths, chunked prefill and n > 1. With the target as its own draft every draft is
accepted: the draft's KV catch-up and rollback leave its cache exactly the target's, so
its greedy continuation is the target's own (a broken catch-up, a stale block or a
position off by one shows as a rejected draft). A random smaller draft is rejected often
and changes nothing. A draft cache too small for the batch evicts and recomputes; a
draft's short context caps its drafts; preemption, an abort and a restart of the step
loop leave no draft block behind; a bad draft is refused at start in one line.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from fault_stages import FAULTS, Fault, fault_graph
from model_fixtures import build_gpt2_dir
from safetensors.torch import load_file, save_file

from flowllm import LLM, SamplingParams
from flowllm.config import ConfigError, engine_config
from flowllm.engine import SPECULATIVE_GRAPH
from flowllm.engine.async_engine import AsyncEngine
from flowllm.engine.loading import build_services
from flowllm.graph.spec import GraphSpec
from flowllm.graph.validator import validate_graph
from flowllm.llm import RequestOutput
from flowllm.mailbox import Mailbox, RequestFailed
from flowllm.messages import GenerateRequest, StructuredOutputs
from flowllm.messages import SamplingParams as Params
from flowllm.models.layers import quantized_formats
from flowllm.stages.propose import Propose
from flowllm.stages.services import EngineServices

HERE = Path(__file__).resolve().parent
VOCAB = 50257
TINY_BLOCK_BYTES = 2 * 2 * 16 * 4 * 16 * 4  # K+V, 2 layers, 16 slots, 4 heads x 16, fp32
COMMON: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 512,
    "max_num_batched_tokens": 64,  # prompts of up to 200 tokens run in chunks
    "kv_cache_memory": 4096 * TINY_BLOCK_BYTES,
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def outputs(out: list[RequestOutput]) -> list[list[tuple[object, ...]]]:
    return [[(o.token_ids, o.text, o.finish_reason, o.logprobs) for o in r.outputs] for r in out]


def metric(registry: Any, name: str, labels: dict[str, str] | None = None) -> float:
    return registry.get_sample_value(name, labels or {}) or 0.0


def drafted(llm: LLM) -> float:
    assert llm.last_run is not None
    return metric(llm.last_run.registry, "flowllm:spec_decode_num_draft_tokens_total")


def accepted(llm: LLM) -> float:
    assert llm.last_run is not None
    return metric(llm.last_run.registry, "flowllm:spec_decode_num_accepted_tokens_total")


def prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts of 1 to 200 tokens (a block, several blocks, several prefill chunks)."""
    rng = random.Random(seed)
    lengths = [1, 2, 15, 16, 17, 63, 64, 65, 130, 200]
    return [[rng.randrange(VOCAB) for _ in range(lengths[i % len(lengths)])] for i in range(count)]


def speculating(target: Path, draft: Path, **spec: Any) -> LLM:
    config = {"model": str(draft), "num_speculative_tokens": 4, "disable_by_batch_size": None}
    return LLM(str(target), speculative_config={**config, **spec}, **COMMON)


@pytest.fixture(scope="module")
def small_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A smaller random GPT-2 (1 layer, 32 wide) with the same tokenizer."""
    return build_gpt2_dir(tmp_path_factory.mktemp("draft"), n_layer=1, n_embd=32, n_head=2, seed=7)


@pytest.fixture(scope="module")
def base(gpt2_tiny_dir: Path) -> LLM:
    return LLM(str(gpt2_tiny_dir), **COMMON)


@pytest.fixture(scope="module")
def itself(gpt2_tiny_dir: Path) -> LLM:
    """The target as its own draft."""
    return speculating(gpt2_tiny_dir, gpt2_tiny_dir)


def test_the_target_as_its_own_draft_has_every_draft_accepted(base: LLM, itself: LLM) -> None:
    batch = prompts(0, 12)
    params = [GREEDY, SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True, n=2)] * 6
    want = outputs(base.generate(batch, params))
    assert outputs(itself.generate(batch, params)) == want
    assert drafted(itself) > 12 * 20
    assert accepted(itself) == drafted(itself)
    # one at a time too: a sequence alone in the draft's batches
    one = prompts(1, 3)
    assert outputs(itself.generate(one, GREEDY)) == outputs(base.generate(one, GREEDY))
    assert accepted(itself) == drafted(itself) > 0


def test_a_random_smaller_draft_changes_no_token(
    base: LLM, gpt2_tiny_dir: Path, small_draft_dir: Path
) -> None:
    spec = speculating(gpt2_tiny_dir, small_draft_dir)
    batch = prompts(2, 10)
    params = [GREEDY, SamplingParams(temperature=0.0, max_tokens=17, logprobs=2, n=2)] * 5
    assert outputs(spec.generate(batch, params)) == outputs(base.generate(batch, params))
    assert 0 <= accepted(spec) < drafted(spec)
    assert drafted(spec) > 10 * 15


def test_a_draft_quantized_to_int8_drafts_and_changes_no_token(
    base: LLM, itself: LLM, gpt2_tiny_dir: Path
) -> None:
    """`quantization: int8` loads the draft's linear layers (but its head) as int8, as
    `--quantization int8` does the target's: its drafts, the continuation of a quantized
    copy of the target, are mostly the target's own, and no token changes."""
    quantized = speculating(gpt2_tiny_dir, gpt2_tiny_dir, quantization="int8")
    draft, plain = quantized.services.draft, itself.services.draft
    assert draft is not None and plain is not None
    assert quantized_formats(draft.model) == ["int8"] and quantized_formats(plain.model) == []
    assert draft.model.lm_head.quantized is None
    batch = prompts(5, 8)
    assert outputs(quantized.generate(batch, GREEDY)) == outputs(base.generate(batch, GREEDY))
    assert drafted(quantized) > 0 and accepted(quantized) > drafted(quantized) / 2


@pytest.mark.parametrize("draft", ["itself", "small"])
def test_seeded_sampled_requests_reproduce_and_equal_the_default_graphs(
    base: LLM, itself: LLM, gpt2_tiny_dir: Path, small_draft_dir: Path, draft: str
) -> None:
    spec = itself if draft == "itself" else speculating(gpt2_tiny_dir, small_draft_dir)
    batch = prompts(3, 8)
    # a low temperature keeps some drafts of the target's own greedy continuation
    params = [
        SamplingParams(temperature=(0.01, 0.8)[i % 2], seed=i, top_k=(0, 50)[i % 2],
                       n=1 + i % 2, max_tokens=24, logprobs=1)
        for i in range(len(batch))
    ]  # fmt: skip
    got = outputs(spec.generate(batch, params))
    assert got == outputs(spec.generate(batch, params))
    assert got == outputs(base.generate(batch, params))
    if draft == "itself":
        assert accepted(spec) > 0


def test_a_large_batch_steps_aside_beside_a_constrained_sequence(
    base: LLM, itself: LLM, gpt2_tiny_dir: Path
) -> None:
    adaptive = speculating(gpt2_tiny_dir, gpt2_tiny_dir, disable_by_batch_size=4)
    batch = prompts(9, 10)
    code = StructuredOutputs(regex="[a-z]{3}-[0-9]{2}")
    params = [
        SamplingParams(temperature=0.0, max_tokens=8 + 4 * i, ignore_eos=i != 3,
                       structured_outputs=code if i == 3 else None)
        for i in range(len(batch))
    ]  # fmt: skip
    want = outputs(base.generate(batch, params))
    assert outputs(adaptive.generate(batch, params)) == want
    assert outputs(itself.generate(batch, params)) == want
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", str(want[3][0][1]))
    # drafts only once the batch has shrunk to 4 sequences; the target drafting for itself
    # drafts what it draws, but for the constrained sequence (when it is still running
    # then) its unconstrained continuation, which the grammar may forbid
    assert 0 < drafted(adaptive) < drafted(itself)
    assert 0 < accepted(adaptive) <= drafted(adaptive)


def test_a_draft_cache_too_small_for_the_batch_evicts_and_recomputes(
    base: LLM, gpt2_tiny_dir: Path
) -> None:
    """12 blocks of 16 tokens: the sequences take the blocks of those idle longest, which
    catch up from their first token when they draft again, and the one of 200 prompt
    tokens, too long for the whole cache, drafts nothing. Every draft made is accepted."""
    spec = speculating(gpt2_tiny_dir, gpt2_tiny_dir, draft_kv_cache_memory=12 * TINY_BLOCK_BYTES)
    batch = prompts(4, 10)
    want = outputs(base.generate(batch, GREEDY))
    assert outputs(spec.generate(batch, GREEDY)) == want
    assert accepted(spec) == drafted(spec) > 0
    assert drafted(spec) < drafted_without_limit(gpt2_tiny_dir, batch)


def drafted_without_limit(target: Path, batch: list[list[int]]) -> float:
    spec = speculating(target, target)
    spec.generate(batch, GREEDY)
    return drafted(spec)


def test_a_draft_with_a_shorter_context_drafts_up_to_its_end(
    base: LLM, gpt2_tiny_dir: Path, tmp_path: Path
) -> None:
    """The target cut to 48 positions: a sequence drafts while its last draft's position
    is within them, then goes on without drafts."""
    short = tmp_path / "short"
    shutil.copytree(gpt2_tiny_dir, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "n_positions": 48}))
    weights = load_file(short / "model.safetensors")
    save_file(
        {**weights, "wpe.weight": weights["wpe.weight"][:48].clone()}, short / "model.safetensors"
    )
    spec = speculating(gpt2_tiny_dir, short)
    batch = [p[:20] for p in prompts(5, 9)[5:]]  # 20 prompt tokens, 60 in all
    assert outputs(spec.generate(batch, GREEDY)) == outputs(base.generate(batch, GREEDY))
    # drafts of the tokens at positions 21 to 48 only (the last one from position 47's
    # logits): at most 28 per sequence, where the target's context would give 39
    assert accepted(spec) == drafted(spec) > 0
    assert drafted(spec) <= 4 * 28


# ------------------------------------------------- preemption, abort, restart: nothing left


@pytest.fixture(scope="module")
def services(gpt2_tiny_dir: Path) -> EngineServices:
    """The target as its own draft, on a target cache small enough to preempt."""
    spec = {"model": str(gpt2_tiny_dir), "disable_by_batch_size": None}
    config = engine_config(
        str(gpt2_tiny_dir),
        **{**COMMON, "max_model_len": 384, "kv_cache_memory": 24 * TINY_BLOCK_BYTES},
        speculative_config=spec,
    )  # fmt: skip
    return build_services(config)


def request(
    services: EngineServices, request_id: str, prompt: list[int], n: int
) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id,
        model=services.served_model_name,
        params=Params(max_tokens=n, temperature=0.0, ignore_eos=True),
        arrival_time=time.monotonic(),
        prompt_token_ids=tuple(prompt),
    )


async def tokens_of(box: Mailbox) -> list[int]:
    out: list[int] = []
    async for chunk in box:
        out.extend(chunk.token_ids)
    return out


async def settled(engine: AsyncEngine) -> None:
    """No sequence left in the step loop's stages, every draft block free (within 2 s)."""
    stage = engine.graph.stage("propose")
    assert isinstance(stage, Propose) and stage.drafter is not None
    drafter = stage.drafter
    registry = engine.services.registry
    with anyio.fail_after(2):
        while (
            not engine.healthy
            or metric(registry, "flowllm:kv_cache_usage_perc")
            or any(
                metric(registry, "flowllm:live_sequences", {"stage": s})
                for s in ("schedule", "sample", "propose")
            )
            or drafter.free_blocks != drafter.draft.num_blocks
        ):
            await anyio.sleep(0.02)
    assert not drafter.holds()


def default_tokens(services: EngineServices, batch: list[list[int]], n: int) -> list[list[int]]:
    async def main() -> list[list[int]]:
        plain = services.fresh()
        async with AsyncEngine.start(services=plain) as engine:
            boxes = [engine.submit(request(plain, f"d{i}", p, n)) for i, p in enumerate(batch)]
            return [await tokens_of(box) for box in boxes]

    return anyio.run(main)


def test_preemption_and_an_abort_mid_run_leave_no_draft_block(services: EngineServices) -> None:
    batch = prompts(6, 8)
    want = default_tokens(services, batch, 40)

    async def main() -> None:
        async with AsyncEngine.start(
            graph=validate_graph(GraphSpec.load(SPECULATIVE_GRAPH)), services=services.fresh()
        ) as engine:
            boxes = [engine.submit(request(services, f"r{i}", p, 40)) for i, p in enumerate(batch)]
            victim = engine.submit(request(services, "victim", prompts(7, 1)[0], 300))
            with anyio.fail_after(30):
                async for chunk in victim:
                    if chunk.token_ids:  # it runs (and drafts): abort it
                        engine.abort("victim")
                        break
                assert [await tokens_of(box) for box in boxes] == want
                await settled(engine)
            registry = engine.services.registry
            assert metric(registry, "flowllm:num_preemptions_total") > 0
            drafts = metric(registry, "flowllm:spec_decode_num_draft_tokens_total")
            assert metric(registry, "flowllm:spec_decode_num_accepted_tokens_total") == drafts > 0

    anyio.run(main)


def test_a_restart_of_the_step_loop_rebuilds_the_drafts_state(services: EngineServices) -> None:
    """propose fails mid-run: the step loop restarts, the requests it lost are answered
    with an error, the others' outputs are unchanged, and the new propose drafts from what
    it sees (every draft still accepted), leaving nothing behind."""
    batch = prompts(8, 4)
    want = default_tokens(services, batch, 30)
    text = fault_graph("propose", base=SPECULATIVE_GRAPH)
    valid = validate_graph(GraphSpec.from_yaml(text, source="<faults>", base_dir=HERE))
    FAULTS["propose"] = Fault(at=4)

    async def main() -> None:
        async with AsyncEngine.start(graph=valid, services=services.fresh()) as engine:
            boxes = [engine.submit(request(services, f"r{i}", p, 30)) for i, p in enumerate(batch)]
            with anyio.fail_after(30):
                for box, tokens in zip(boxes, want, strict=True):
                    try:
                        assert await tokens_of(box) == tokens
                    except RequestFailed as failed:
                        assert failed.error.kind == "internal"
                later = [
                    engine.submit(request(services, f"l{i}", p, 30)) for i, p in enumerate(batch)
                ]
                assert [await tokens_of(box) for box in later] == want
                await settled(engine)
            registry = engine.services.registry
            assert metric(registry, "flowllm:stage_restarts_total", {"group": "step_loop"}) == 1
            drafts = metric(registry, "flowllm:spec_decode_num_draft_tokens_total")
            assert metric(registry, "flowllm:spec_decode_num_accepted_tokens_total") == drafts > 0

    try:
        anyio.run(main)
    finally:
        FAULTS.clear()


# ------------------------------------------------------------------- refused at start


def test_a_bad_draft_is_one_line_naming_the_field(
    gpt2_tiny_dir: Path, small_draft_dir: Path, tmp_path: Path
) -> None:
    def refused(spec: dict[str, Any]) -> str:
        with pytest.raises(ConfigError) as raised:
            LLM(str(gpt2_tiny_dir), speculative_config=spec, **COMMON)
        message = str(raised.value)
        assert "\n" not in message and message.startswith("speculative_config: ")
        return message

    said = refused({"model": str(tmp_path / "nowhere")})
    assert f"model {str(tmp_path / 'nowhere')!r} does not exist" in said
    other_size = tmp_path / "other-size"
    shutil.copytree(small_draft_dir, other_size)
    config = json.loads((other_size / "config.json").read_text())
    (other_size / "config.json").write_text(json.dumps({**config, "vocab_size": 32000}))
    said = refused({"model": str(other_size)})
    assert "vocabulary of 32000 tokens, the target's has 50257" in said
    other_tokens = tmp_path / "other-tokens"
    shutil.copytree(small_draft_dir, other_tokens)
    tokenizer = json.loads((other_tokens / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]
    (other_tokens / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert "another tokenizer vocabulary" in refused({"model": str(other_tokens)})
    no_weights = tmp_path / "no-weights"
    shutil.copytree(small_draft_dir, no_weights)
    (no_weights / "model.safetensors").unlink()
    assert "no safetensors weights" in refused({"model": str(no_weights)})
    with pytest.raises(ConfigError, match="quantization must be one of"):
        LLM(str(gpt2_tiny_dir), speculative_config={"model": "x", "quantization": "q4"}, **COMMON)
    with pytest.raises(ConfigError, match="quantization applies to a draft model"):
        LLM(str(gpt2_tiny_dir), speculative_config={"quantization": "int8"}, **COMMON)
    with pytest.raises(ConfigError, match="unknown field `draft_models`"):
        LLM(str(gpt2_tiny_dir), speculative_config={"draft_models": "x"}, **COMMON)
