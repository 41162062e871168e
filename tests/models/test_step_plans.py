"""Decode steps replayed from recorded kernel calls (`flowllm.models.step_plans`) give the
eager run's logits and K/V bit for bit, step after step, as positions, slots, lengths and
block tables change; models that compute with torch in their layers stay eager; a bad
input raises the eager run's error; plans stay within their memory limit."""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable

import pytest
import torch
from model_test_utils import STEP_VOCAB, Blocks, PagedSeq, schedule, step_gpt2, step_llama

from flowllm.config import engine_config
from flowllm.engine.args import add_engine_arguments, config_from_args
from flowllm.kernels import cpu_linear
from flowllm.kernels.reference import KernelInputError
from flowllm.messages import ScheduledSeq
from flowllm.models.gpt2 import GPT2Model
from flowllm.models.kv_cache import KVCacheSpec
from flowllm.models.llama import LlamaModel
from flowllm.models.runner import ModelRunner
from flowllm.stages.execute import Execute
from flowllm.stages.services import EngineServices, already_loaded

pytestmark = pytest.mark.usefixtures("native_build")  # each build in turn
BLOCK = 4
VOCAB = STEP_VOCAB
NUM_BLOCKS = 64


def gpt2(dtype: torch.dtype, activation: str = "gelu_new") -> GPT2Model:
    return step_gpt2(dtype, activation=activation)


def llama(dtype: torch.dtype) -> LlamaModel:
    return step_llama(dtype)


def runners(model: torch.nn.Module) -> tuple[ModelRunner, ModelRunner]:
    """(eager, planned), each on its own copy of one randomly filled cache."""
    kv = KVCacheSpec.for_model(model, BLOCK).allocate(NUM_BLOCKS, "cpu")
    for k, v in kv:
        k.normal_()
        v.normal_()
    kv_copy = [(k.clone(), v.clone()) for k, v in kv]
    eager = ModelRunner(model, kv, BLOCK, "cpu", enforce_eager=True)
    return eager, ModelRunner(model, kv_copy, BLOCK, "cpu")


def assert_same_caches(a: ModelRunner, b: ModelRunner) -> None:
    for (ka, va), (kb, vb) in zip(a.kv_caches, b.kv_caches, strict=True):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("build", [llama, gpt2])
def test_replayed_decode_steps_match_eager_ones_bit_for_bit(
    build: Callable[[torch.dtype], torch.nn.Module], dtype: torch.dtype
) -> None:
    eager, planned = runners(build(dtype))
    assert eager.plans is None and planned.plans is not None
    # without the bf16 product (the AVX2 build, or no AVX512-BF16) bf16 linear layers are
    # torch's: every step stays eager, and still computes the same
    recordable = cpu_linear.serves(dtype)
    rng = random.Random(dtype.itemsize)
    seqs = [PagedSeq(i, [rng.randrange(VOCAB) for _ in range(60)]) for i in range(3)]
    blocks = Blocks(NUM_BLOCKS)

    def step(plan: list[tuple[int, int]]) -> None:
        scheduled = [schedule(seqs[i], n, blocks, BLOCK) for i, n in plan]
        want, _ = eager.run(scheduled)
        got, _ = planned.run(scheduled)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert got.untyped_storage().data_ptr() != want.untyped_storage().data_ptr()
        for i, n in plan:
            seqs[i].num_computed += n

    step([(0, 5), (1, 2), (2, 3)])  # prefills: never recorded
    assert not planned.plans.plans
    step([(0, 1), (1, 1), (2, 1)])  # first decode of this shape: eager
    assert not planned.plans.plans
    step([(0, 1), (1, 1), (2, 1)])  # the second: recorded
    assert len(planned.plans.plans) == recordable
    # Decodes crossing block boundaries and table widths 2 -> 4 -> 8 -> 16, a mixed step in
    # between (eager), then two of the three sequences (another shape).
    for k in range(25):
        step([(0, 1), (1, 1), (2, 1)] if k != 10 else [(0, 1), (1, 4), (2, 1)])
    for _ in range(4):
        step([(2, 1), (0, 1)])
    assert_same_caches(eager, planned)
    widths = sorted(key[2] for key in planned.plans.plans)
    if recordable:
        assert widths == [(2, 16), (3, 2), (3, 4), (3, 8)]
        assert planned.plans.refused is None
    else:
        assert widths == [] and (planned.plans.refused or "").startswith("it runs the torch op")


def test_models_computing_with_torch_in_their_layers_stay_eager() -> None:
    eager, planned = runners(gpt2(torch.float32, activation="gelu"))  # erf GELU: torch's
    seqs = [
        ScheduledSeq(seq_id=0, token_ids=(t,), num_computed_tokens=5 + t, block_table=(3, 9, 4),
                     sample=True, num_output_tokens=0)
        for t in range(3)
    ]  # fmt: skip
    for s in seqs:
        torch.testing.assert_close(planned.run([s])[0], eager.run([s])[0], rtol=0, atol=0)
    assert planned.plans is not None and not planned.plans.plans
    assert planned.plans.refused == "it runs the torch op torch._C._nn.gelu"
    assert_same_caches(eager, planned)


def test_a_bad_input_at_replay_raises_the_eager_error_and_drops_the_plan() -> None:
    _, planned = runners(llama(torch.float32))

    def decode(block: int) -> ScheduledSeq:
        return ScheduledSeq(seq_id=0, token_ids=(7,), num_computed_tokens=5,
                            block_table=(2, block), sample=True, num_output_tokens=0)  # fmt: skip

    planned.run([decode(5)])
    planned.run([decode(6)])
    assert planned.plans is not None and len(planned.plans.plans) == 1
    with pytest.raises(KernelInputError, match="token 0's slot 4005 is outside the cache"):
        planned.run([decode(1001)])
    assert not planned.plans.plans


def test_plans_stay_within_their_memory_limit() -> None:
    _, planned = runners(llama(torch.float32))
    plans = planned.plans
    assert plans is not None

    def decodes(n: int) -> list[ScheduledSeq]:
        return [
            ScheduledSeq(seq_id=i, token_ids=(i,), num_computed_tokens=2, block_table=(i,),
                         sample=True, num_output_tokens=0)
            for i in range(n)
        ]  # fmt: skip

    for n in (1, 2, 1, 2):
        planned.run(decodes(n))
    one, two = (plans.plans[k].nbytes for k in plans.plans)
    assert two == 2 * one > 0
    plans.memory_limit = 5 * one + one // 2  # room for the plans of 2 and 3, not of 1 too
    for _ in range(2):
        planned.run(decodes(3))  # recorded: 1's plan goes (least recently used), 2's stays
    assert [k[0][0] for k in plans.plans] == [2, 3] and plans.nbytes <= plans.memory_limit
    plans.memory_limit = 4 * one - 1  # 4's plan alone exceeds it: never kept
    for _ in range(3):
        planned.run(decodes(4))
    assert [k[0][0] for k in plans.plans] == [2, 3]


def test_enforce_eager_reaches_the_runner() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, model_optional=True)
    assert config_from_args(parser.parse_args(["--enforce-eager"])).model.enforce_eager
    assert not config_from_args(parser.parse_args([])).model.enforce_eager
    model = llama(torch.float32)
    for eager in (True, False):
        services = EngineServices(
            config=engine_config("tiny", enforce_eager=eager), model=model,
            tokenizer_loader=already_loaded(None),
            kv_caches=[], num_blocks=1, max_model_len=64, eos_token_ids=(0,),
            device=torch.device("cpu"),
        )  # fmt: skip
        assert (Execute(None, services).runner.plans is None) is eager
