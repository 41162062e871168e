"""The kernels as torch ops (`torch.ops.flowllm.*`, csrc/ops.cpp), called directly: each op
has its schema, its written arguments marked; on each build they give torch's results; bad
arguments raise a clear error before anything runs, on every build and on none; fake tensors
and torch.compile see them; with no build in use they refuse to run."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from kernel_builds import use_kernel_build
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from flowllm.kernels import fused, native
from flowllm.kernels.reference import KernelInputError

DTYPES = [torch.float32, torch.bfloat16]
# each op and the arguments its schema says it writes
WRITES: dict[str, set[str]] = {
    "linear": {"y"},
    "decode_attention": {"out"},
    "store_kv": {"k_cache", "v_cache"},
    "rms_norm": {"residual", "out"},
    "layer_norm": {"residual", "out"},
    "rope": {"x"},
    "silu_mul": {"out"},
    "gelu_tanh": {"out"},
    "argmax_rows": {"out"},
    "qlinear": {"y"},
    "dequant": {"out"},
    "record_start": set(),
    "record_stop": set(),
    "run_calls": set(),
}
RECORDING = ("record_start", "record_stop", "run_calls")  # CPU only, no Meta implementation


@pytest.fixture(scope="module", autouse=True)
def _ops_loaded() -> None:
    """The ops library loaded (it stays), by activating a build once, whichever test runs
    first; the process then back to its own build."""
    with use_kernel_build("avx2"):
        pass


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal within float32's sums, or bit for bit in bfloat16 (one rounding, as torch's)."""
    tol = 1e-5 if got.dtype == torch.float32 else 0.0
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def sevens(*shape: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    """An output buffer whose every element says it was not written."""
    return torch.full(shape, 7, dtype=dtype, device=device)


@pytest.mark.parametrize("name", list(WRITES))
def test_schema_marks_written_arguments(name: str) -> None:
    """Each op has its schema; exactly the arguments it writes are marked written, no return
    aliases an input, and every tensor op has a CPU and a Meta implementation."""
    schema = torch.ops.flowllm.__getattr__(name).default._schema
    assert schema.name == f"flowllm::{name}"
    written = {a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write}
    assert written == WRITES[name]
    assert all(r.alias_info is None for r in schema.returns)
    if name not in RECORDING:
        assert schema.is_mutable
        for key in ("CPU", "Meta"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(schema.name, key)


@pytest.mark.usefixtures("native_build")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "inter"), [(5, 37), (3, 256)])
def test_silu_mul_is_torchs(dtype: torch.dtype, n: int, inter: int) -> None:
    """silu_mul writes F.silu(gate) * up of the [gate | up] halves of each row."""
    torch.manual_seed(inter)
    gate_up = (4 * torch.randn(n, 2 * inter)).to(dtype)
    out = sevens(n, inter, dtype=dtype)
    torch.ops.flowllm.silu_mul(gate_up, out)
    gate, up = gate_up.chunk(2, -1)
    _close(out, F.silu(gate) * up)


@pytest.mark.usefixtures("native_build")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 37), (16, 300)])
def test_gelu_tanh_is_torchs(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    """gelu_tanh writes F.gelu(x, approximate="tanh"), within one bf16 rounding in bf16."""
    torch.manual_seed(shape[1])
    x = (4 * torch.randn(shape)).to(dtype)
    out = sevens(*shape, dtype=dtype)
    torch.ops.flowllm.gelu_tanh(x, out)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, F.gelu(x, approximate="tanh"), rtol=tol, atol=1e-5)


@pytest.mark.usefixtures("native_build")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_is_torchs(dtype: torch.dtype, with_residual: bool) -> None:
    """rms_norm writes the RMSNorm of x, or of residual + x with that sum written back into
    residual as torch rounds it; float32 as F.rms_norm, bf16 bit for bit as the transformers
    formula (the normalized row rounded before the weight)."""
    torch.manual_seed(3)
    n, d, eps = 7, 96, 1e-5
    x, residual = torch.randn(n, d).to(dtype), torch.randn(n, d).to(dtype)
    weight = (0.5 + torch.rand(d)).to(dtype)
    total = residual + x if with_residual else x
    stream = residual.clone() if with_residual else None
    out = sevens(n, d, dtype=dtype)
    torch.ops.flowllm.rms_norm(x, stream, weight, out, eps)
    if stream is not None:
        assert torch.equal(stream, total)
    if dtype == torch.float32:
        _close(out, F.rms_norm(total, (d,), weight, eps))
    else:
        h = total.float()
        normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
        torch.testing.assert_close(out, normed * weight, rtol=0, atol=0)


@pytest.mark.usefixtures("native_build")
def test_argmax_rows_is_torchs() -> None:
    """argmax_rows writes torch.argmax of each row: first index of ties, strided rows."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randint(0, 3, (9, 1037), generator=gen).float()  # many ties
    x[1] = float("-inf")
    x[2, -1] = 9.0
    x[3:] = torch.randn(6, 1037, generator=gen)
    wide = torch.cat([x, torch.full((9, 5), 100.0)], dim=1)[:, :1037]  # row stride > cols
    for rows in (x, wide):
        out = sevens(9, dtype=torch.int64)
        torch.ops.flowllm.argmax_rows(rows, out)
        assert torch.equal(out, x.argmax(dim=1))


def _attention(
    out: torch.Tensor,
    seq_lens_dtype: torch.dtype = torch.int32,
    cache_shape: tuple[int, ...] = (3, 4, 2, 16),
) -> None:
    """decode_attention of 2 tokens of 4 heads on a 2-head cache (out: [2, 4, 16])."""
    q, cache = torch.randn(2, 4, 16), torch.randn(cache_shape)
    tables, lens = torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, dtype=seq_lens_dtype)
    torch.ops.flowllm.decode_attention(
        q, cache, cache.clone(), tables, lens, None, None, 0.25, 0, 0.0, out
    )


GATE_UP = torch.randn(3, 8)
X = torch.randn(3, 8)
Error = type[Exception] | tuple[type[Exception], ...]
# (what is wrong, the untouched output's shape and dtype, the call, error, message)
BAD_CALLS: list[tuple[str, tuple[int, ...], torch.dtype, Callable[..., object], Error, str]] = [
    ("float64", (3, 4), torch.float32,
     lambda o: torch.ops.flowllm.silu_mul(GATE_UP.double(), o),
     TypeError, "gate_up must be float32 or bfloat16, got Double"),
    ("out-dtype", (3,), torch.int32, lambda o: torch.ops.flowllm.argmax_rows(X, o),
     TypeError, "out must be Long, got Int"),
    ("index-dtype", (2, 4, 16), torch.float32, lambda o: _attention(o, torch.int64),
     TypeError, "seq_lens must be Int, got Long"),
    ("strided", (3, 4), torch.float32,
     lambda o: torch.ops.flowllm.silu_mul(torch.randn(8, 3).t(), o),
     ValueError, r"gate_up must be contiguous, got shape \[3, 8\] strides \[1, 3\]"),
    ("out-shape", (3, 5), torch.float32, lambda o: torch.ops.flowllm.silu_mul(GATE_UP, o),
     ValueError, r"out must be of shape \[3, 4\], got \[3, 5\]"),
    ("weight-shape", (3, 8), torch.float32,
     lambda o: torch.ops.flowllm.rms_norm(X, None, torch.ones(7), o, 1e-5),
     ValueError, r"weight must be of shape \[8\], got \[7\]"),
    ("attention-out", (2, 4, 32), torch.float32, _attention,
     ValueError, r"out must be \[tokens, heads, head_dim=16\]"),
    ("meta-input", (3, 4), torch.float32,
     lambda o: torch.ops.flowllm.silu_mul(GATE_UP.to("meta"), o),
     RuntimeError, "out is on cpu, not meta"),
    ("meta-weight", (3, 8), torch.float32,
     lambda o: torch.ops.flowllm.rms_norm(X, None, torch.ones(8, device="meta"), o, 1e-5),
     RuntimeError, "weight is on meta, not cpu"),
    ("no-kv-heads", (2, 4, 16), torch.float32, lambda o: _attention(o, cache_shape=(3, 4, 0, 16)),
     ValueError, "each but num_blocks positive"),
    ("tokens-overlap", (2, 4, 16), torch.float32,
     lambda o: _attention(o.as_strided((2, 4, 16), (0, 16, 1))),
     ValueError, "tokens apart"),
    ("rows-overlap", (3, 8), torch.float32,
     lambda o: torch.ops.flowllm.rope(o[:1].expand(3, 8), torch.zeros(4, 2, 8),
                                      torch.zeros(3).long(), 1, 8),
     ValueError, "x must be"),
    ("heads-overflow", (3, 8), torch.float32,
     lambda o: torch.ops.flowllm.rope(o, torch.zeros(4, 2, 8), torch.zeros(3).long(),
                                      1 << 62, 8),
     ValueError, "do not fit rows of 8"),
    ("int-for-tensor", (3, 4), torch.float32, lambda o: torch.ops.flowllm.silu_mul(3, o),
     (RuntimeError, TypeError), "Expected a value of type 'Tensor' for argument 'gate_up'"),
]  # fmt: skip


@pytest.mark.usefixtures("kernel_build")  # none in use ("torch") too: the checks come first
@pytest.mark.parametrize(
    ("shape", "dtype", "call", "error", "message"),
    [case[1:] for case in BAD_CALLS],
    ids=[case[0] for case in BAD_CALLS],
)
def test_bad_arguments_raise_before_anything_runs(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    call: Callable[[torch.Tensor], object],
    error: Error,
    message: str,
) -> None:
    """A wrong dtype (TypeError), layout or shape (ValueError), device (RuntimeError) or
    argument type (the dispatcher's error) is refused with a message naming the argument,
    and the output buffer keeps what it held."""
    out = sevens(*shape, dtype=dtype)
    with pytest.raises(error, match=message):
        call(out)
    assert (out == 7).all()


def test_fake_tensors_run_the_meta_checks() -> None:
    """Under FakeTensorMode the ops run their Meta implementations: a well-formed call
    returns and writes nothing, an ill-shaped one raises ValueError."""
    out, x = sevens(3, 8), torch.randn(3, 8)
    with FakeTensorMode() as mode:
        fake_out, fake_x = mode.from_tensor(out), mode.from_tensor(x)
        assert isinstance(fake_out, FakeTensor)
        assert torch.ops.flowllm.rms_norm(fake_x, None, torch.ones(8), fake_out, 1e-5) is None
        with pytest.raises(ValueError, match=r"weight must be of shape \[8\]"):
            torch.ops.flowllm.rms_norm(fake_x, None, torch.ones(7), fake_out, 1e-5)
        q, cache = torch.empty(2, 4, 16), torch.empty(3, 4, 2, 16)
        tables, lens = torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
        args = (q, cache, cache.clone(), tables, lens, None, None, 0.25, 0, 0.0)
        assert torch.ops.flowllm.decode_attention(*args, torch.empty_like(q)) is None
        with pytest.raises(ValueError, match="must match"):
            torch.ops.flowllm.decode_attention(*args, torch.empty(2, 2, 16))
    assert (out == 7).all()


@pytest.mark.usefixtures("native_build")
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_sees_the_ops(backend: str) -> None:
    """torch.compile traces a whole function (fullgraph) that allocates outputs and calls
    the ops, writing a residual input in place and rotating in place (ops whose kernels
    check index values raise what they refuse, so none returns a value a trace would fix),
    with eager's results."""
    table = torch.randn(8, 2, 16)
    positions = torch.tensor([0, 3, 7, 1])

    def fn(gate_up: torch.Tensor, residual: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        act = torch.empty_like(gate_up[:, : gate_up.shape[1] // 2])
        torch.ops.flowllm.silu_mul(gate_up, act)
        out = torch.empty_like(act)
        torch.ops.flowllm.rms_norm(act, residual, w, out, 1e-5)
        torch.ops.flowllm.rope(out, table, positions, 1, 16)
        return out

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    gate_up, residual, w = torch.randn(4, 32), torch.randn(4, 16), torch.rand(16) + 0.5
    eager_residual, compiled_residual = residual.clone(), residual.clone()
    want = fn(gate_up, eager_residual, w)
    assert torch.equal(compiled(gate_up, compiled_residual, w), want)
    assert torch.equal(compiled_residual, eager_residual)  # the sum, written back
    gate, up = gate_up.chunk(2, -1)
    torch.testing.assert_close(eager_residual, residual + F.silu(gate) * up)
    with pytest.raises(ValueError, match="positions fall outside"):
        torch.ops.flowllm.rope(torch.randn(4, 16), table, torch.tensor([0, 8, 1, 2]), 1, 16)
    torch._dynamo.reset()


@pytest.mark.usefixtures("native_build")
def test_a_call_list_is_checked_for_its_framing() -> None:
    """run_calls refuses a list whose last call is cut short, or whose word count runs
    past its end, before running any call of it."""
    out = torch.empty(3, 4)  # alive as long as the list that addresses it
    torch.ops.flowllm.record_start()
    torch.ops.flowllm.silu_mul(GATE_UP, out)
    calls = torch.ops.flowllm.record_stop()
    out.fill_(7)
    assert torch.ops.flowllm.run_calls(calls) == 0
    gate, up = GATE_UP.chunk(2, -1)
    torch.testing.assert_close(out, F.silu(gate) * up)
    for bad in (calls[:-1], torch.cat([calls, calls[:1]]), torch.tensor([0, 1 << 62])):
        out.fill_(7)
        with pytest.raises(ValueError, match="malformed call list"):
            torch.ops.flowllm.run_calls(bad)
        assert (out == 7).all()


def test_no_build_in_use_refuses_to_run() -> None:
    """With no build in use the ops check their arguments, then refuse to run on CPU
    tensors (the output untouched); the Meta implementations need no build."""
    with use_kernel_build("torch"):
        assert native.library() is None
        out = sevens(3, 4)
        with pytest.raises(RuntimeError, match="no native kernel build is in use"):
            torch.ops.flowllm.silu_mul(GATE_UP, out)
        assert (out == 7).all()
        with pytest.raises(KernelInputError, match="not available on this machine"):
            fused.silu_mul(GATE_UP)  # the layers' functions say so in their own error
        with pytest.raises(RuntimeError, match="no native kernel build is in use"):
            torch.ops.flowllm.rope(X.clone(), torch.zeros(4, 2, 8), torch.zeros(3).long(), 1, 8)
        torch.ops.flowllm.silu_mul(GATE_UP.to("meta"), out.to("meta"))
