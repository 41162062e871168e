"""The kernels' typed interface: the Python declaration of every argument struct equals the
library's own (both builds), and bad arguments raise before any kernel runs."""

from __future__ import annotations

import ctypes

import pytest
import torch

from flowllm.kernels import native
from flowllm.kernels.kernel_args import ARGS, Float, Int, KernelArgumentError, Tensor, _args


def _lib(isa: str) -> native.NativeLibrary:
    if not native.cpu_flags() >= native.ISAS[isa].cpu_flags:
        pytest.skip(f"this CPU cannot run the {isa} build")
    try:
        return native.isa_library(isa)
    except OSError as exc:
        pytest.skip(f"no {isa} build here: {exc}")


@pytest.mark.parametrize("isa", list(native.ISAS))
def test_every_struct_matches_the_library(isa: str) -> None:
    """Field names, C types, offsets and sizes, and each struct's size: the C header's as the
    compiler laid them out against the Python declarations."""
    layouts = _lib(isa).layouts
    assert set(layouts) == set(ARGS)
    for symbol, args in ARGS.items():
        assert layouts[symbol] == args.layout(), symbol


@pytest.mark.parametrize("isa", list(native.ISAS))
def test_each_kernel_of_the_build_binds(isa: str) -> None:
    """Both builds export every declared kernel but the AVX2 one the bf16 linear product
    (AVX512-BF16), which it reports absent (`has_bf16`); each binds to its struct."""
    lib = _lib(isa)
    exported = {s for s in ARGS if hasattr(lib._symbols, s)}
    if isa == "avx512":
        assert exported == set(ARGS)
    else:
        assert exported == set(ARGS) - {"flowllm_linear_bf16"}
        assert not lib.has_bf16
    for symbol in exported:
        assert lib.kernel(symbol).args is ARGS[symbol]


def test_a_layout_that_differs_is_refused(
    native_build: native.NativeLibrary, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Python declaration with two fields swapped no longer matches the library: binding the
    kernel raises instead of handing it misplaced arguments."""
    lib = native_build
    original = ARGS["flowllm_silu_mul_f32"]
    x = Tensor("float", (torch.float32,))
    out = Tensor("float", (torch.float32,), const=False)
    swapped = _args("silu_mul_f32", ("gate_up", x), ("out", out), ("inter", Int()), ("n", Int()))
    monkeypatch.setitem(ARGS, "flowllm_silu_mul_f32", swapped)
    with pytest.raises(OSError, match="argument struct"):
        lib.kernel("flowllm_silu_mul_f32")
    monkeypatch.setitem(ARGS, "flowllm_silu_mul_f32", original)
    assert lib.kernel("flowllm_silu_mul_f32").args is original


def test_named_arguments_run_the_kernel(native_build: native.NativeLibrary) -> None:
    """silu(gate) * up through the typed call, against torch."""
    silu_mul = native_build.kernel("flowllm_silu_mul_f32")
    gate_up = torch.randn(3, 32)
    out = torch.empty(3, 16)
    assert silu_mul(gate_up=gate_up, out=out, n=3, inter=16) == 0
    expected = torch.nn.functional.silu(gate_up[:, :16]) * gate_up[:, 16:]
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"gate_up": torch.randn(3, 32, dtype=torch.float64)}, "must be torch.float32"),
        ({"gate_up": torch.randn(32, 3).t()}, "must be contiguous"),
        ({"gate_up": torch.empty(3, 32, device="meta")}, "must be on the CPU"),
        ({"gate_up": [1.0] * 96}, "must be a tensor"),
        ({"out": None}, "out is required"),
        ({"n": 3.0}, "n must be an int"),
        ({"n": True}, "n must be an int"),
        ({"n": 1 << 63}, "does not fit int64"),
        ({"inter": None}, "inter must be an int"),
    ],
)
def test_bad_arguments_raise_before_the_call(
    native_build: native.NativeLibrary, change: dict[str, object], message: str
) -> None:
    silu_mul = native_build.kernel("flowllm_silu_mul_f32")
    out = torch.full((3, 16), 7.0)
    named: dict[str, object] = {"gate_up": torch.randn(3, 32), "out": out, "n": 3, "inter": 16}
    named.update(change)
    with pytest.raises(KernelArgumentError, match=message):
        silu_mul(**named)
    assert bool((out == 7.0).all())  # nothing ran


def test_missing_and_unknown_names_raise(native_build: native.NativeLibrary) -> None:
    silu_mul = native_build.kernel("flowllm_silu_mul_f32")
    gate_up, out = torch.randn(3, 32), torch.empty(3, 16)
    with pytest.raises(KernelArgumentError, match=r"missing \['inter'\]"):
        silu_mul(gate_up=gate_up, out=out, n=3)
    with pytest.raises(KernelArgumentError, match=r"unknown \['width'\]"):
        silu_mul(gate_up=gate_up, out=out, n=3, width=16)


def test_floats_and_optional_pointers(native_build: native.NativeLibrary) -> None:
    """A double field takes ints and floats; an optional pointer None (NULL), which the RMSNorm
    kernel reads as "no residual"."""
    rms_norm = native_build.kernel("flowllm_rms_norm_f32")
    x, w = torch.randn(2, 16), torch.rand(16)
    out = torch.empty(2, 16)
    rms_norm(x=x, residual=None, weight=w, out=out, n=2, d=16, eps=1)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1.0) * w
    torch.testing.assert_close(out, expected)
    with pytest.raises(KernelArgumentError, match="eps must be a float"):
        rms_norm(x=x, residual=None, weight=w, out=out, n=2, d=16, eps="1e-6")


def test_ctypes_structure_is_the_packed_bytes() -> None:
    """`pack` gives exactly the bytes of the ctypes Structure built from the same values."""
    args = ARGS["flowllm_rms_norm_f32"]
    x, w, out = torch.randn(2, 16), torch.rand(16), torch.empty(2, 16)
    packed = args.pack(x=x, residual=None, weight=w, out=out, n=2, d=16, eps=0.5)
    built = args(x=x.data_ptr(), residual=None, weight=w.data_ptr(), out=out.data_ptr(),
                 n=2, d=16, eps=0.5)  # fmt: skip
    assert packed == bytes(built)
    assert len(packed) == ctypes.sizeof(args)
    assert isinstance(dict(args.kinds)["eps"], Float)
