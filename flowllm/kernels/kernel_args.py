"""The typed interface of the native kernels: one argument struct per kernel, declared here
as a `ctypes.Structure` that mirrors `csrc/kernel_args.h`, built from named arguments.

Why: a kernel reads its arguments as the bytes of its C struct; a field out of order or of
the wrong kind would be read as something else and corrupt memory without an error. Here
each field says what it holds (a tensor of given dtypes, an int64, a double), `pack`
checks every argument against it (tensor type, dtype, device, layout; a missing or unknown
name) and raises `KernelArgumentError` before any call, and the library's own description
of its structs (`flowllm_args_layout`) is compared with these declarations when a kernel
is bound (`NativeLibrary.kernel`) and, for every struct, by tests/kernels.

Shapes are checked by each kernel's caller (cpu_attention, fused, ...), which know them.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn

import torch

__all__ = [
    "ARGS",
    "Float",
    "Int",
    "KernelArgs",
    "KernelArgumentError",
    "Tensor",
    "c_layout",
]


class KernelArgumentError(TypeError):
    """A kernel argument is missing, unknown, or not what its struct field holds."""


@dataclass(frozen=True)
class Tensor:
    """A pointer field: a CPU tensor of one of `dtypes` (C element type `c_type`), contiguous,
    or with `rows=True` rows of unit element stride whose row stride another field gives;
    `optional`: None passes NULL."""

    c_type: str
    dtypes: tuple[torch.dtype, ...]
    const: bool = True
    rows: bool = False
    optional: bool = False

    def c_decl(self) -> str:
        return f"{'const ' if self.const else ''}{self.c_type} *"

    def address(self, kernel: str, name: str, value: Any) -> int:
        if value is None:
            if self.optional:
                return 0
            raise KernelArgumentError(f"{kernel}: {name} is required, got None")
        if not isinstance(value, torch.Tensor):
            raise KernelArgumentError(f"{kernel}: {name} must be a tensor, got {type(value)}")
        if value.dtype not in self.dtypes:
            raise KernelArgumentError(
                f"{kernel}: {name} must be {' or '.join(map(str, self.dtypes))}, got {value.dtype}"
            )
        if value.device.type != "cpu":
            raise KernelArgumentError(f"{kernel}: {name} must be on the CPU, got {value.device}")
        if self.rows:
            if value.dim() and value.stride(-1) != 1:
                raise KernelArgumentError(
                    f"{kernel}: {name}'s rows must have unit stride, got strides {value.stride()}"
                )
        elif not value.is_contiguous():
            raise KernelArgumentError(
                f"{kernel}: {name} must be contiguous, got shape {tuple(value.shape)} strides "
                f"{value.stride()}"
            )
        return int(value.data_ptr())


@dataclass(frozen=True)
class Int:
    """An int64_t field."""

    def c_decl(self) -> str:
        return "int64_t"

    def value(self, kernel: str, name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise KernelArgumentError(f"{kernel}: {name} must be an int, got {type(value)}")
        if not -(1 << 63) <= value < 1 << 63:
            raise KernelArgumentError(f"{kernel}: {name}={value} does not fit int64")
        return value


@dataclass(frozen=True)
class Float:
    """A double field."""

    def c_decl(self) -> str:
        return "double"

    def value(self, kernel: str, name: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise KernelArgumentError(f"{kernel}: {name} must be a float, got {type(value)}")
        return float(value)


Kind = Tensor | Int | Float
_CTYPES = {Int: ctypes.c_int64, Float: ctypes.c_double, Tensor: ctypes.c_void_p}


class KernelArgs(ctypes.Structure):
    """A kernel's argument struct (see the module docstring); subclasses come from `_args`."""

    kernel: ClassVar[str]  # the kernel's symbol, flowllm_<name>
    kinds: ClassVar[tuple[tuple[str, Kind], ...]]
    _packer: ClassVar[struct.Struct]

    @classmethod
    def pack(cls, **named: Any) -> bytes:
        """The struct's bytes from one named argument per field, each checked."""
        if len(named) != len(cls.kinds):
            cls._mismatch(named)
        values: list[int | float] = []
        for name, kind in cls.kinds:
            try:
                value = named[name]
            except KeyError:
                cls._mismatch(named)
            if isinstance(kind, Tensor):
                values.append(kind.address(cls.kernel, name, value))
            else:
                values.append(kind.value(cls.kernel, name, value))
        return cls._packer.pack(*values)

    @classmethod
    def _mismatch(cls, named: dict[str, Any]) -> NoReturn:
        missing = [n for n, _ in cls.kinds if n not in named]
        unknown = [n for n in named if n not in dict(cls.kinds)]
        raise KernelArgumentError(f"{cls.kernel}: missing {missing}, unknown {unknown}")

    @classmethod
    def layout(cls) -> list[tuple[str, str, int, int]]:
        """(field, C type, offset, size) of each field, then ("", "", 0, the struct's size),
        as `flowllm_args_layout` describes the C struct."""
        fields = [
            (name, kind.c_decl(), getattr(cls, name).offset, getattr(cls, name).size)
            for name, kind in cls.kinds
        ]
        return [*fields, ("", "", 0, ctypes.sizeof(cls))]


def _args(kernel: str, *fields: tuple[str, Kind]) -> type[KernelArgs]:
    """The KernelArgs subclass of `flowllm_<kernel>`."""
    members = {
        "_fields_": [(name, _CTYPES[type(kind)]) for name, kind in fields],
        "kernel": f"flowllm_{kernel}",
        "kinds": fields,
        "_packer": struct.Struct(
            "=" + "".join("d" if isinstance(k, Float) else "q" for _, k in fields)
        ),
    }
    return type(f"{kernel.title().replace('_', '')}Args", (KernelArgs,), members)


F32, BF16, F16 = (torch.float32,), (torch.bfloat16,), (torch.float16,)
I32, I64 = (torch.int32,), (torch.int64,)
INT64, DOUBLE = Int(), Float()
_ELEMENT = {"f32": ("float", F32), "bf16": ("bf16_t", BF16)}
_CODES = {"q4": ("uint8_t", (torch.uint8,)), "q8": ("int8_t", (torch.int8,))}
_SCALES = {"f16": ("f16_t", F16), "f32": ("float", F32)}
_ACTIVATIONS = (torch.float32, torch.bfloat16)


def _typed(suffix: str) -> Iterator[type[KernelArgs]]:
    """The elementwise kernels' structs over one element type."""
    c, dt = _ELEMENT[suffix]
    x, out = Tensor(c, dt), Tensor(c, dt, const=False)
    residual = Tensor(c, dt, const=False, optional=True)
    yield _args(
        f"rms_norm_{suffix}",
        ("x", x),
        ("residual", residual),
        ("weight", x),
        ("out", out),
        ("n", INT64),
        ("d", INT64),
        ("eps", DOUBLE),
    )
    yield _args(
        f"layer_norm_{suffix}",
        ("x", x),
        ("residual", residual),
        ("weight", x),
        ("bias", x),
        ("out", out),
        ("n", INT64),
        ("d", INT64),
        ("eps", DOUBLE),
    )
    yield _args(
        f"rope_{suffix}",
        ("x", Tensor(c, dt, const=False, rows=True)),
        ("table", x),
        ("table_rows", INT64),
        ("positions", Tensor("int64_t", I64)),
        ("n", INT64),
        ("heads", INT64),
        ("head_dim", INT64),
        ("row_stride", INT64),
        ("rot", INT64),
    )
    yield _args(f"silu_mul_{suffix}", ("gate_up", x), ("out", out), ("n", INT64), ("inter", INT64))
    yield _args(f"gelu_tanh_{suffix}", ("x", x), ("y", out), ("numel", INT64))


def _quantized(codes: str, scales: str) -> Iterator[type[KernelArgs]]:
    """The quantized products' structs over one code and one scale layout."""
    c = Tensor(*_CODES[codes])
    s = Tensor(*_SCALES[scales])
    mins = Tensor(*_SCALES[scales], optional=True)
    name = f"{codes}_{scales}"
    yield _args(
        f"qlinear_{name}",
        ("x", Tensor("void", _ACTIVATIONS)),
        ("codes", c),
        ("scales", s),
        ("mins", mins),
        ("bias", Tensor("void", _ACTIVATIONS, optional=True)),
        ("y", Tensor("void", _ACTIVATIONS, const=False)),
        ("m", INT64),
        ("n", INT64),
        ("k", INT64),
        ("group", INT64),
        ("interleaved", INT64),
        ("bf16", INT64),
    )
    yield _args(
        f"dequant_{name}",
        ("codes", c),
        ("scales", s),
        ("mins", mins),
        ("ids", Tensor("int64_t", I64, optional=True)),
        ("rows", INT64),
        ("row0", INT64),
        ("out", Tensor("float", F32, const=False)),
        ("n", INT64),
        ("k", INT64),
        ("group", INT64),
        ("interleaved", INT64),
    )


def _all() -> Iterator[type[KernelArgs]]:
    yield _args(
        "linear_f32",
        ("x", Tensor("float", F32)),
        ("w", Tensor("float", F32)),
        ("bias", Tensor("float", F32, optional=True)),
        ("y", Tensor("float", F32, const=False)),
        ("m", INT64),
        ("n", INT64),
        ("k", INT64),
    )
    yield _args(
        "linear_bf16",
        ("x", Tensor("bf16_t", BF16)),
        ("w", Tensor("bf16_t", BF16)),
        ("bias", Tensor("bf16_t", BF16, optional=True)),
        ("y", Tensor("void", (torch.bfloat16, torch.float32), const=False)),
        ("m", INT64),
        ("n", INT64),
        ("k", INT64),
        ("f32_out", INT64),
    )
    cache = Tensor("void", _ACTIVATIONS)
    yield _args(
        "decode_attention",
        ("bf16", INT64),
        ("query", Tensor("void", _ACTIVATIONS, rows=True)),
        ("q_stride", INT64),
        ("k_cache", cache),
        ("v_cache", cache),
        ("num_blocks", INT64),
        ("block_size", INT64),
        ("kv_heads", INT64),
        ("group", INT64),
        ("head_dim", INT64),
        ("block_tables", Tensor("int32_t", I32)),
        ("table_stride", INT64),
        ("seq_lens", Tensor("int32_t", I32)),
        ("num_seqs", INT64),
        ("seqs", Tensor("int64_t", I64, optional=True)),
        ("rows", Tensor("int64_t", I64, optional=True)),
        ("n", INT64),
        ("num_tokens", INT64),
        ("scale", DOUBLE),
        ("window", INT64),
        ("softcap", DOUBLE),
        ("out", Tensor("void", _ACTIVATIONS, const=False, rows=True)),
        ("out_stride", INT64),
    )
    yield _args(
        "store_kv",
        ("key", Tensor("void", _ACTIVATIONS, rows=True)),
        ("key_stride", INT64),
        ("value", Tensor("void", _ACTIVATIONS, rows=True)),
        ("value_stride", INT64),
        ("k_cache", Tensor("void", _ACTIVATIONS, const=False)),
        ("v_cache", Tensor("void", _ACTIVATIONS, const=False)),
        ("num_slots", INT64),
        ("slots", Tensor("int64_t", I64)),
        ("n", INT64),
        ("row", INT64),
        ("elem_size", INT64),
    )
    for suffix in _ELEMENT:
        yield from _typed(suffix)
    yield _args(
        "argmax_rows_f32",
        ("x", Tensor("float", F32, rows=True)),
        ("rows", INT64),
        ("cols", INT64),
        ("row_stride", INT64),
        ("out", Tensor("int64_t", I64, const=False)),
    )
    for codes in _CODES:
        for scales in _SCALES:
            yield from _quantized(codes, scales)
    yield _args("run_calls", ("calls", Tensor("int64_t", I64)), ("len", INT64))


ARGS: dict[str, type[KernelArgs]] = {cls.kernel: cls for cls in _all()}
"""Each kernel's argument struct, by the kernel's symbol."""


class _Field(ctypes.Structure):
    _fields_ = [
        ("args", ctypes.c_char_p),
        ("name", ctypes.c_char_p),
        ("type", ctypes.c_char_p),
        ("offset", ctypes.c_int64),
        ("size", ctypes.c_int64),
    ]


def c_layout(symbols: ctypes.CDLL) -> dict[str, list[tuple[str, str, int, int]]]:
    """The library's description of its structs, by kernel symbol, in `KernelArgs.layout`'s
    form (types with their spacing normalized)."""
    fn = symbols.flowllm_args_layout
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.POINTER(ctypes.POINTER(_Field))]
    entries = ctypes.POINTER(_Field)()
    count = fn(ctypes.byref(entries))
    out: dict[str, list[tuple[str, str, int, int]]] = {}
    for i in range(count):
        e = entries[i]
        kernel = e.args.decode().removesuffix("_args")
        c_type = " ".join(e.type.decode().replace("*", " *").split())
        out.setdefault(kernel, []).append((e.name.decode(), c_type, e.offset, e.size))
    return out
