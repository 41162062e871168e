"""Decode steps replayed from graphs of padded capture sizes (`flowllm.models.decode_buckets`,
`flowllm.models.cuda_graphs`, `flowllm.models.step_plans`).

On CPU a stand-in graph reruns the captured function over the graph's static inputs, so
everything but the CUDA capture itself runs here: the capture sizes from the config, the
padding of a step's inputs, which steps replay and which run eagerly, and logits and K/V
against the eager runner's, bit for bit where the product kernels are batch invariant.
The CUDA test captures real graphs (benchmarks/gpu_check.sh runs it)."""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from model_test_utils import (
    STEP_VOCAB,
    Blocks,
    PagedSeq,
    random_weights,
    schedule,
    step_gpt2,
    step_llama,
)
from transformers import Qwen3MoeConfig

from flowllm.config import engine_config
from flowllm.engine.args import add_engine_arguments, config_from_args
from flowllm.kernels import cpu_linear, native
from flowllm.models.cuda_graphs import GraphBackend
from flowllm.models.decode_buckets import DecodeBuckets, capture_sizes
from flowllm.models.gpt2 import GPT2Model
from flowllm.models.kv_cache import KVCacheSpec
from flowllm.models.llama import LlamaModel
from flowllm.models.moe import Qwen3MoeModel
from flowllm.models.plan_backend import Outputs
from flowllm.models.runner import ModelRunner
from flowllm.models.step_plans import StepPlans
from flowllm.models.warm_up import warm_up
from flowllm.stages.execute import Execute
from flowllm.stages.services import EngineServices, already_loaded

BLOCK = 4
VOCAB = STEP_VOCAB
NUM_BLOCKS = 64
PAD_BLOCK = NUM_BLOCKS - 1  # never handed out: the padding rows' K/V go there on CPU
MAX_MODEL_LEN = 128
SIZES = (1, 2, 4, 8)
# The CPU stand-in for a graph sits where the native call plans do: without native kernels
# (FLOWLLM_NATIVE_KERNELS=0) the runner keeps no plans at all.
needs_native = pytest.mark.skipif(
    native.library() is None, reason="the CPU step plans need the native kernels"
)


def gpt2(dtype: torch.dtype, device: str = "cpu", positions: int = MAX_MODEL_LEN) -> GPT2Model:
    return step_gpt2(dtype, device, positions)


def llama(dtype: torch.dtype, device: str = "cpu", positions: int = MAX_MODEL_LEN) -> LlamaModel:
    return step_llama(dtype, device, positions)


class Rerun:
    """A graph's stand-in on CPU: replaying reruns the function over the static inputs
    into the outputs of its capture."""

    def __init__(self, fn: Callable[..., Outputs], static: tuple[torch.Tensor, ...]) -> None:
        self.fn, self.static = fn, static
        self.outputs = fn(*static)
        self.replays = 0

    def replay(self) -> None:
        for out, new in zip(self.outputs, self.fn(*self.static), strict=True):
            out.copy_(new)
        self.replays += 1


def rerun_capture(
    fn: Callable[..., Outputs], static: tuple[torch.Tensor, ...]
) -> tuple[Rerun, Outputs]:
    graph = Rerun(fn, static)
    return graph, graph.outputs


def runners(
    model: torch.nn.Module, sizes: tuple[int, ...] = SIZES
) -> tuple[ModelRunner, ModelRunner]:
    """(eager, graphed), each on its own copy of one randomly filled cache; the graphed
    one's decode graphs captured."""
    kv = KVCacheSpec.for_model(model, BLOCK).allocate(NUM_BLOCKS, "cpu")
    for k, v in kv:
        k.normal_()
        v.normal_()
    kv_copy = [(k.clone(), v.clone()) for k, v in kv]
    eager = ModelRunner(model, kv, BLOCK, "cpu", enforce_eager=True)
    graphed = ModelRunner(model, kv_copy, BLOCK, "cpu", enforce_eager=True)
    buckets = DecodeBuckets.for_context(sizes, MAX_MODEL_LEN, BLOCK, pad_slot=PAD_BLOCK * BLOCK)
    graphed.plans = StepPlans(model, kv_copy, GraphBackend(buckets, rerun_capture), buckets)
    assert graphed.plans.capture(graphed.workspace) == len(sizes)
    return eager, graphed


def replays(runner: ModelRunner) -> dict[int, int]:
    """Replays so far by capture size."""
    assert runner.plans is not None
    return {key[0][0]: plan.graph.replays for key, plan in runner.plans.plans.items()}  # type: ignore[attr-defined]


def test_capture_sizes_default_to_vllms_and_follow_the_config() -> None:
    assert capture_sizes(256) == (1, 2, 4, *range(8, 257, 8))
    assert capture_sizes(1000)[-3:] == (496, 504, 512)  # at most 512 by default
    assert capture_sizes(1000, max_size=1024)[-1] == 1000  # never above max_num_seqs
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)  # the largest decode batch included
    assert capture_sizes(3) == (1, 2, 3)
    assert capture_sizes(256, [64, 1, 300, 8, 8]) == (1, 8, 64)
    assert capture_sizes(1000, [1, 600]) == (1, 600)  # given sizes: no default ceiling
    assert capture_sizes(256, [1, 2, 4, 8, 16], max_size=8) == (1, 2, 4, 8)
    assert capture_sizes(256, max_size=0) == ()

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, model_optional=True)
    config = config_from_args(
        parser.parse_args(
            ["--cuda-graph-sizes", "1", "2", "4", "--max-cudagraph-capture-size", "2"]
        )
    )
    assert config.model.cudagraph_capture_sizes == (1, 2, 4)
    assert config.model.max_cudagraph_capture_size == 2
    defaults = config_from_args(parser.parse_args([])).model
    assert defaults.cudagraph_capture_sizes is None and defaults.max_cudagraph_capture_size is None


def test_buckets_pad_to_the_smallest_size_and_a_table_of_the_longest_context() -> None:
    buckets = DecodeBuckets.for_context((1, 2, 4, 8), max_model_len=1000, block_size=16)
    assert buckets.width == 64 and buckets.max_seq_len == 1024  # 63 blocks, rounded up
    assert [buckets.rows_for(n, 8) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]
    assert buckets.rows_for(3, 64) == 4 and buckets.rows_for(3, 128) is None


def test_padding_rows_are_one_token_at_the_pad_slot_and_real_rows_are_copied() -> None:
    model = llama(torch.float32)
    kv = KVCacheSpec.for_model(model, BLOCK).allocate(NUM_BLOCKS, "cpu")
    runner = ModelRunner(model, kv, BLOCK, "cpu", enforce_eager=True)
    seqs = [PagedSeq(i, list(range(3 + 5 * i))) for i in range(3)]
    blocks = Blocks(PAD_BLOCK)
    for s in seqs:
        s.num_computed = len(s.tokens) - 1
    inp, input_ids, positions, ctx = runner.build_context(
        [schedule(s, 1, blocks, BLOCK) for s in seqs]
    )
    h = model.embed(input_ids, positions)
    buckets = DecodeBuckets.for_context(SIZES, MAX_MODEL_LEN, BLOCK, pad_slot=PAD_BLOCK * BLOCK)
    out = buckets.padding(torch.full((8, h.shape[1]), float("nan")))
    buckets.pad_into(
        out, (h, positions, ctx.slot_mapping, ctx.block_tables, ctx.query_start_loc, ctx.seq_lens)
    )
    o_h, o_positions, o_slots, o_tables, o_qsl, o_lens = out
    assert torch.equal(o_h[:3], h) and not o_h[3:].any()
    assert o_positions.tolist() == [2, 7, 12, 0, 0, 0, 0, 0]
    slots = [
        s.blocks[p // BLOCK] * BLOCK + p % BLOCK for s, p in zip(seqs, (2, 7, 12), strict=True)
    ]
    assert o_slots.tolist() == slots + [PAD_BLOCK * BLOCK] * 5
    assert o_tables.shape == (8, 32)
    for i, s in enumerate(seqs):
        assert o_tables[i].tolist() == s.blocks + [0] * (32 - len(s.blocks))
    assert not o_tables[3:].any()
    assert o_qsl.tolist() == list(range(9))
    assert o_lens.tolist() == [3, 8, 13, 1, 1, 1, 1, 1]
    assert inp.max_query_len == 1


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("build", [llama, gpt2])
def test_replayed_padded_decode_steps_match_eager_ones(
    build: Callable[[torch.dtype], torch.nn.Module], dtype: torch.dtype
) -> None:
    eager, graphed = runners(build(dtype))
    exact = cpu_linear.serves(dtype)  # else torch's products, whose sums follow the row count
    rng = random.Random(dtype.itemsize)
    seqs = [PagedSeq(i, [rng.randrange(VOCAB) for _ in range(40)]) for i in range(10)]
    blocks = Blocks(PAD_BLOCK)

    def step(plan: list[tuple[int, int]]) -> None:
        scheduled = [schedule(seqs[i], n, blocks, BLOCK) for i, n in plan]
        want, _ = eager.run(scheduled)
        got, _ = graphed.run(scheduled)
        if exact:
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        else:
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        for i, n in plan:
            seqs[i].num_computed += n

    step([(i, 3 + i) for i in range(10)])  # prefills: eager
    assert replays(graphed) == dict.fromkeys(SIZES, 0)
    for n in (1, 3, 5, 8, 2):  # padded to 1, 4, 8, 8, 2
        step([(i, 1) for i in range(n)])
    assert replays(graphed) == {1: 1, 2: 1, 4: 1, 8: 2}
    step([(i, 1) for i in range(9)])  # larger than every capture size: eager
    step([(0, 1), (1, 4), (2, 1)])  # mixed: eager
    for _ in range(12):  # decodes across block boundaries and table widths
        step([(i, 1) for i in (2, 0, 1)])
    assert replays(graphed) == {1: 1, 2: 1, 4: 13, 8: 2}
    for (ka, va), (kb, vb) in zip(eager.kv_caches, graphed.kv_caches, strict=True):
        # the padding rows wrote the pad block alone
        assert torch.equal(ka[:PAD_BLOCK], kb[:PAD_BLOCK]) and torch.equal(
            va[:PAD_BLOCK], vb[:PAD_BLOCK]
        )


def test_a_model_that_routes_on_values_stays_eager() -> None:
    cfg = Qwen3MoeConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
        num_experts_per_tok=2, vocab_size=VOCAB, max_position_embeddings=128,
    )  # fmt: skip
    model = random_weights(Qwen3MoeModel(cfg, torch.float32, "cpu"))
    kv = KVCacheSpec.for_model(model, BLOCK).allocate(NUM_BLOCKS, "cpu")
    buckets = DecodeBuckets.for_context(SIZES, MAX_MODEL_LEN, BLOCK, pad_slot=PAD_BLOCK * BLOCK)
    plans = StepPlans(model, kv, GraphBackend(buckets, rerun_capture), buckets)
    assert plans.capture() == 0 and not plans.plans
    assert plans.refused == "it reads values into Python (Tensor.tolist)"


@needs_native
def test_enforce_eager_and_the_cpu_keep_their_own_plans() -> None:
    model = llama(torch.float32)
    kv = KVCacheSpec.for_model(model, BLOCK).allocate(NUM_BLOCKS, "cpu")
    buckets = DecodeBuckets.for_context(SIZES, MAX_MODEL_LEN, BLOCK)
    eager = ModelRunner(model, kv, BLOCK, "cpu", enforce_eager=True, decode_buckets=buckets)
    assert eager.plans is None
    cpu = ModelRunner(model, kv, BLOCK, "cpu", decode_buckets=buckets)
    assert cpu.plans is None or cpu.plans.buckets is None  # exact shapes, as they come
    for eager_flag in (True, False):
        services = EngineServices(
            config=engine_config("tiny", enforce_eager=eager_flag), model=model,
            tokenizer_loader=already_loaded(None),
            kv_caches=kv, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN,
            eos_token_ids=(0,), device=torch.device("cpu"),
        )  # fmt: skip
        runner = Execute(None, services).runner  # warm-up is CUDA's alone: nothing ran
        assert runner.plans is None if eager_flag else runner.plans.buckets is None
        assert not runner.plans or not runner.plans.plans


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("build", [llama, gpt2])
def test_cuda_graphs_replay_decode_steps_up_to_the_longest_context(
    build: Callable[..., torch.nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real graphs: the warm-up captures every size; decode steps of contexts up to the
    longest replay them (the model's layers are not called: captured under the longest
    context's launch parameters, the attention splits short contexts the eager step does
    not) and give the eager runner's logits."""
    block, num_blocks, max_model_len = 16, 512, 1024
    model = build(torch.float32, "cuda", max_model_len)
    kv = KVCacheSpec.for_model(model, block).allocate(num_blocks, "cuda")
    eager = ModelRunner(model, kv, block, "cuda", enforce_eager=True)
    kv_copy = [(k.clone(), v.clone()) for k, v in kv]
    buckets = DecodeBuckets.for_context(SIZES, max_model_len, block)
    graphed = ModelRunner(model, kv_copy, block, "cuda", decode_buckets=buckets)
    warm_up(graphed, 64)
    assert graphed.plans is not None and graphed.plans.refused is None
    assert len(graphed.plans.plans) == len(SIZES)
    rng = random.Random(0)
    seqs = [PagedSeq(i, [rng.randrange(VOCAB) for _ in range(max_model_len)]) for i in range(6)]
    blocks = Blocks(num_blocks)
    prefill = [
        schedule(s, n, blocks, block)
        for s, n in zip(seqs, (5, 40, 200, 600, 1000, 1020), strict=True)
    ]
    for runner in (eager, graphed):
        runner.run(prefill)
    for s, p in zip(seqs, prefill, strict=True):
        s.num_computed += len(p.token_ids)
    calls = 0
    layers = model.forward_layers

    def counted(*args: Any) -> Outputs:
        nonlocal calls
        calls += 1
        return layers(*args)

    monkeypatch.setattr(model, "forward_layers", counted)
    for n in (6, 3, 1, 5, 6):
        scheduled = [schedule(s, 1, blocks, block) for s in seqs[:n]]
        want, _ = eager.run(scheduled)
        before = calls
        got, _ = graphed.run(scheduled)
        assert calls == before  # replayed
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for s in seqs[:n]:
            s.num_computed += 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_every_run_of_the_graph_shares_one_warmed_up_runner() -> None:
    model = llama(torch.float32, "cuda")
    kv = KVCacheSpec.for_model(model, BLOCK).allocate(NUM_BLOCKS, "cuda")
    services = EngineServices(
        config=engine_config("tiny", max_num_seqs=12), model=model,
        tokenizer_loader=already_loaded(None),
        kv_caches=kv, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN,
        eos_token_ids=(0,), device=torch.device("cuda"),
    )  # fmt: skip
    runner = Execute(None, services).runner
    assert Execute(None, services.fresh()).runner is runner
    assert runner.plans is not None and runner.plans.buckets is not None
    assert runner.plans.buckets.sizes == (1, 2, 4, 8, 12) and len(runner.plans.plans) == 5
