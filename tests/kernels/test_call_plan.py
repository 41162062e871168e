"""Recording native kernel calls and replaying them (`flowllm.kernels.call_plan`): a replay
computes what the function computes on the new inputs, functions that compute with torch
are refused, the tensors a plan addresses stay alive, and a kernel's refusal at replay
hands back to the caller."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import weakref

import pytest
import torch

from flowllm.kernels import call_plan, fused, native
from flowllm.kernels.reference import KernelInputError
from flowllm.models.layers import RotaryEmbedding
from flowllm.models.rope import rope_frequencies, rope_parameters

pytestmark = pytest.mark.usefixtures("native_build")  # each build in turn
D = 64


def lib() -> native.NativeLibrary:
    library = native.library()
    assert library is not None
    return library


def norm_then_gate(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> tuple:
    """Three kernel calls with views and allocations between them."""
    normed = fused.rms_norm(x, weight, 1e-5, residual)  # residual += x, in place
    gated = fused.silu_mul(normed.view(x.shape[0], 2, D // 2).view(x.shape[0], D))
    return fused.rms_norm(gated, weight[: D // 2].contiguous(), 1e-5), residual


def inputs(seed: int, n: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D, generator=g), torch.randn(n, D, generator=g)


def test_replay_computes_the_function_on_new_inputs() -> None:
    weight = 0.5 + torch.rand(D)
    x, res = inputs(0)
    recorded = call_plan.record(lambda a, b: norm_then_gate(a, b, weight), (x, res))
    plan = recorded.plan
    assert plan is not None and recorded.refused is None
    assert plan.num_calls == 3
    # The recording ran on copies: the caller's residual was not added into.
    assert torch.equal(res, inputs(0)[1])
    want = norm_then_gate(x.clone(), res.clone(), weight)
    for got, expected in zip(recorded.outputs, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for seed in (1, 2, 3):
        x, res = inputs(seed)
        out = plan.replay((x, res))
        assert out is plan.outputs  # the same tensors, overwritten each time
        want = norm_then_gate(x.clone(), res.clone(), weight)
        for got, expected in zip(out, want, strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # its temporaries: the first norm's [3, D] and the gate's and last norm's [3, D/2]
    assert plan.nbytes == (3 * D + 2 * 3 * (D // 2)) * 4


@pytest.mark.parametrize(
    ("compute", "op"),
    [
        (lambda t: t + 1, "Tensor.add"),
        (lambda t: t.clone(), "Tensor.clone"),
        (lambda t: t.sum(), "Tensor.sum"),
        (lambda t: torch.zeros(3), "torch.zeros"),
        (lambda t: torch.empty(3).add_(1), "Tensor.add_"),  # in place, on a new tensor
        (lambda t: torch.empty(3).__setitem__(0, 1.0), "Tensor.__setitem__"),
        (lambda t: torch.add(t, 1, out=torch.empty_like(t)), "torch.add"),
        (lambda t: t.t().contiguous(), "Tensor.contiguous"),
        (lambda t: t.reshape(2, -1).t().reshape(-1), "Tensor.reshape"),
        (lambda t: t[torch.tensor([0])], "torch.tensor"),
        (lambda t: torch.nn.functional.silu(t), "torch.nn.functional.silu"),
    ],
)
def test_a_torch_op_between_the_calls_refuses_the_plan(compute: object, op: str) -> None:
    weight = torch.ones(D)

    def fn(x: torch.Tensor, res: torch.Tensor) -> tuple:
        compute(x)  # type: ignore[operator]
        return norm_then_gate(x, res, weight)

    x, res = inputs(4)
    recorded = call_plan.record(fn, (x, res))
    assert recorded.plan is None and recorded.refused == f"it runs the torch op {op}"
    # The eager run still happened, on the copies.
    torch.testing.assert_close(recorded.outputs[0], norm_then_gate(x, res, weight)[0])


@pytest.mark.parametrize("read", ["tolist", "item", "__int__", "__bool__", "numpy"])
def test_reading_values_into_python_refuses_the_plan(read: str) -> None:
    weight = torch.ones(D)

    def fn(x: torch.Tensor, res: torch.Tensor) -> tuple:
        getattr(x[0, 0], read)()
        return norm_then_gate(x, res, weight)

    recorded = call_plan.record(fn, inputs(5))
    assert recorded.plan is None
    assert recorded.refused == f"it reads values into Python (Tensor.{read})"


def test_a_function_without_kernel_calls_is_refused() -> None:
    x, res = inputs(6)
    recorded = call_plan.record(lambda a, b: (a.view(-1), b[1:]), (x, res))
    assert recorded.plan is None and recorded.refused == "it calls no native kernel"


def test_replay_checks_shapes_and_dtypes() -> None:
    weight = torch.ones(D)
    plan = call_plan.record(lambda a, b: norm_then_gate(a, b, weight), inputs(7)).plan
    assert plan is not None
    x, res = inputs(7, n=4)
    with pytest.raises(ValueError, match=r"input 0 is \(4, 64\).*recorded for \(3, 64\)"):
        plan.replay((x, res))
    x, res = inputs(7)
    with pytest.raises(ValueError, match="bfloat16"):
        plan.replay((x.bfloat16(), res))
    with pytest.raises(ValueError, match="takes 2 inputs"):
        plan.replay((x,))


def test_the_plan_keeps_alive_what_it_addresses_and_a_kernels_refusal_returns_none() -> None:
    """A table made for the recording and then dropped by its owner (as a model replacing
    its rotary table) is still read by the replays; positions past it make the rope kernel
    refuse, and replay says so instead of raising."""
    inv_freq = rope_frequencies({}, rope_parameters({}), D).inv_freq
    rotary = RotaryEmbedding(inv_freq, 32, torch.float32, torch.device("cpu"))

    def rotate(x: torch.Tensor, positions: torch.Tensor) -> tuple:
        fused.rope_(x, 2, D, rotary.table, positions)
        return (x,)

    table_ref = weakref.ref(rotary.table)
    x = torch.randn(3, 2 * D)
    positions = torch.tensor([0, 5, 31])
    plan = call_plan.record(rotate, (x, positions)).plan
    assert plan is not None
    want = rotate(x.clone(), positions)[0]
    rotary.table = torch.full_like(rotary.table, float("nan"))  # the owner moves on
    gc.collect()
    assert table_ref() is not None  # kept by the plan
    out = plan.replay((x, positions))
    assert out is not None
    torch.testing.assert_close(out[0], want, rtol=0, atol=0)
    assert plan.replay((x, torch.tensor([0, 5, 32]))) is None  # row 32 is past the table
    with pytest.raises(KernelInputError, match="outside the rotary table's 32 rows"):
        rotate(x.clone(), torch.tensor([0, 5, 32]))  # the eager run names the problem
    del plan
    gc.collect()
    assert table_ref() is None


def test_recording_belongs_to_one_thread() -> None:
    lib()
    weight = torch.ones(D)
    other_calls: list[int] = []

    def fn(x: torch.Tensor, res: torch.Tensor) -> tuple:
        # Another thread's kernel call while this one records is not part of the plan.
        t = threading.Thread(
            target=lambda: other_calls.append(len(norm_then_gate(*inputs(9), weight)))
        )
        t.start()
        t.join()
        return norm_then_gate(x, res, weight)

    plan = call_plan.record(fn, inputs(8)).plan
    assert other_calls == [2] and plan is not None and plan.num_calls == 3
    torch.ops.flowllm.record_start()
    with pytest.raises(RuntimeError, match="already recording"):
        torch.ops.flowllm.record_start()
    assert torch.ops.flowllm.record_stop().numel() == 0
    with pytest.raises(RuntimeError, match="not recording"):
        torch.ops.flowllm.record_stop()


def test_recording_does_not_import_the_compiler() -> None:
    """A first recording happens while serving: it must not import torch._dynamo (over a
    second), which torch's dispatch modes pull in unless told nothing is compiled."""
    script = (
        "import sys, torch\n"
        "from flowllm.kernels import call_plan, fused, native\n"
        "assert native.library() is not None\n"
        "w = torch.ones(8)\n"
        "r = call_plan.record(lambda x: (fused.rms_norm(x, w, 1e-5),), (torch.randn(2, 8),))\n"
        "assert r.plan is not None, r.refused\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "False", out.stdout + out.stderr
