"""Record the native kernel calls a function makes, once; replay them as one C call.

Why: a decode step of one batch shape makes the same kernel calls on the same buffers every
time, only the values in its inputs change, and at small batches the Python between those
calls (module calls, shape checks, views, allocations) is a large part of the step
(benchmarks/README.md "Where a batch-1 step's time went before replay"). Replaying the
recorded calls removes it, as CUDA graphs do on a GPU.

`record(fn, inputs)` runs `fn` eagerly on copies of `inputs` (the plan's static inputs)
while the ops library appends the thread's kernel calls to a call list (the step's graph,
built once per batch shape: `torch.ops.flowllm.record_start`/`record_stop`), under one
torch function mode (`torch.overrides`) that:

- allows only allocations, views and the kernels' own ops: a torch call whose tensor
  result neither is a new empty tensor nor shares an argument's storage computes something
  a replay would not redo, as does any call that writes in place (`add_`, `x[i] = y`,
  `out=`), so the function is not recordable;
- refuses reading a tensor's values into Python (`.tolist()`, `.item()`, `int(t)`: a
  decision on them would be frozen into the plan);
- keeps every tensor whose address was taken (`data_ptr`) for as long as the plan lives:
  the function's temporaries, the static inputs, and the weights, caches and tables it
  read. Every address in the call list stays valid, even if a model replaces a table
  afterwards (the plan keeps reading the old one, whose rows the kernels check against
  the inputs).

The mode sees the calls Python makes, which is what can come between two kernel calls:
whatever a torch function does inside it is judged by its result.

`CallPlan.replay(inputs)` copies new inputs into the static ones, runs the call list in one
op (`torch.ops.flowllm.run_calls`, the GIL released) and returns the recorded outputs: the
same tensors every time, which the next replay overwrites. Kernels check the values they
index with (lengths, block ids, slots, positions) before writing; when one refuses,
`replay` returns None and the caller runs `fn` eagerly, which raises that kernel's error
with its message.

What a plan cannot see is a Python decision made on anything other than the inputs'
shapes, dtypes and strides (a scalar argument, a flag): the caller keys its plans by
everything those decisions depend on.

Why a call list beside the ops' public forms: the ops have schemas and Meta
implementations, so torch.compile traces them, but what it produces still calls them one
by one from its wrapper; a call list runs a step's kernels in one op with no Python
between them, which is what a batch-1 step needs (benchmarks/README.md "Where a batch-1
step's time went before replay").
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CallPlan", "Recorded", "ValueReads", "record", "recording"]

_state = threading.local()


def recording() -> bool:
    """Whether this thread is recording a plan now: a function that has a torch path and a
    native one for the same work takes the native one then."""
    return bool(getattr(_state, "recording", False))


Outputs = tuple[torch.Tensor, ...]

_ALLOCATIONS = frozenset(
    {torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty,
     torch.Tensor.new_empty_strided}
)  # fmt: skip
_KERNEL_OPS = "torch._ops.flowllm"  # the module of torch.ops.flowllm's ops and overloads
_READS_VALUES = frozenset(
    {
        *(
            getattr(torch.Tensor, name)
            for name in (
                "tolist", "item", "numpy", "__int__", "__float__", "__bool__", "__index__",
                "__complex__", "__repr__", "__format__",
            )
        ),
        torch.equal,
        torch.allclose,
    }
)  # fmt: skip
_IN_PLACE_DUNDERS = frozenset(
    {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
     "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
     "__imatmul__"}
)  # fmt: skip


def _name(func: Any) -> str:
    """`Tensor.clone`, `torch.zeros`: what a refusal names."""
    name = getattr(func, "__name__", repr(func))
    if getattr(torch.Tensor, name, None) is func:
        return f"Tensor.{name}"
    return f"{getattr(func, '__module__', None) or 'torch'}.{name}"


def _storages(value: Any) -> set[int]:
    """The storages of the tensors in `value` (a tensor, or a tuple or list of them); a
    tensor without one (oneDNN's packed weights) stands for itself."""
    if isinstance(value, torch.Tensor):
        try:
            return {value.untyped_storage().data_ptr()}
        except NotImplementedError:  # an opaque tensor
            return {id(value)}
    if isinstance(value, (tuple, list)):
        return {p for item in value for p in _storages(item)}
    return set()


def _writes_in_place(func: Any, kwargs: dict[str, Any]) -> bool:
    name = getattr(func, "__name__", "")
    dunder = name.startswith("__") and name.endswith("__")
    return "out" in kwargs or name in _IN_PLACE_DUNDERS or (name.endswith("_") and not dunder)


class _Recording(TorchFunctionMode):
    """Notes the first torch call that computes (neither a view nor an allocation) and the
    first read of a tensor's values into Python (some, as `tolist`, return no tensor at
    all); counts the bytes allocated, and keeps every tensor whose `data_ptr()` is taken."""

    def __init__(self) -> None:
        super().__init__()
        self.computes: str | None = None
        self.reads_values: str | None = None
        self.allocated = 0
        self.tensors: dict[int, torch.Tensor] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(func, "__module__", None) == _KERNEL_OPS:  # a kernel: it records itself
            for value in [*args, *kwargs.values()]:
                if isinstance(value, torch.Tensor):
                    self.tensors[id(value)] = value
        elif func is torch.Tensor.data_ptr:
            self.tensors[id(args[0])] = args[0]
        elif func in _READS_VALUES:
            self.reads_values = self.reads_values or f"Tensor.{func.__name__}"
        elif func in _ALLOCATIONS:
            self.allocated += out.untyped_storage().nbytes()
        elif _writes_in_place(func, kwargs) or not _storages(out) <= _storages(
            [*args, *kwargs.values()]
        ):
            self.computes = self.computes or _name(func)
        return out


class ValueReads(TorchFunctionMode):
    """Notes the first read of a tensor's values into Python: a replay of a CUDA graph
    would keep the decision made on them."""

    def __init__(self) -> None:
        super().__init__()
        self.refused: str | None = None

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _READS_VALUES and self.refused is None:
            self.refused = f"Tensor.{func.__name__}"
        return func(*args, **(kwargs or {}))


class CallPlan:
    """A recorded call list, the static inputs it reads and the outputs it writes."""

    def __init__(
        self,
        inputs: Outputs,
        outputs: Outputs,
        calls: torch.Tensor,
        keep: Iterable[torch.Tensor],
        nbytes: int,
    ) -> None:
        self.inputs = inputs
        self.outputs = outputs
        self.nbytes = nbytes  # what the plan's temporaries hold
        self._calls = calls
        self._keep = tuple(keep)
        self.num_calls = _count_calls(calls.numpy())

    def replay(self, inputs: Sequence[torch.Tensor]) -> Outputs | None:
        """The outputs for `inputs` (shaped, typed as the recorded ones), or None when a
        kernel refused their values (nothing after it ran)."""
        if len(inputs) != len(self.inputs):
            raise ValueError(f"the plan takes {len(self.inputs)} inputs, got {len(inputs)}")
        for i, (static, new) in enumerate(zip(self.inputs, inputs, strict=True)):
            if new.shape != static.shape or new.dtype != static.dtype:
                raise ValueError(
                    f"input {i} is {tuple(new.shape)} {new.dtype}; the plan was recorded "
                    f"for {tuple(static.shape)} {static.dtype}"
                )
            static.copy_(new)
        status = torch.ops.flowllm.run_calls(self._calls)
        return None if status else self.outputs


@dataclass(frozen=True)
class Recorded:
    """What `record` ran: `fn`'s outputs for the inputs, and the plan replaying it, or why
    there is none."""

    outputs: Outputs
    plan: CallPlan | None
    refused: str | None = None


def record(fn: Callable[..., Outputs], inputs: Sequence[torch.Tensor]) -> Recorded:
    """Run `fn(*copies of inputs)` eagerly, recording its native calls (see module); the
    native kernels must be active (`native.library()`)."""
    static = tuple(t.clone() for t in inputs)
    mode = _Recording()
    torch.ops.flowllm.record_start()
    _state.recording = True
    try:
        with mode:
            outputs = fn(*static)
    finally:
        _state.recording = False
        calls = torch.ops.flowllm.record_stop()
    if mode.reads_values is not None:
        return Recorded(outputs, None, f"it reads values into Python ({mode.reads_values})")
    if mode.computes is not None:
        return Recorded(outputs, None, f"it runs the torch op {mode.computes}")
    if not calls.numel():
        return Recorded(outputs, None, "it calls no native kernel")
    plan = CallPlan(static, outputs, calls, mode.tensors.values(), mode.allocated)
    return Recorded(outputs, plan)


def _count_calls(calls: np.ndarray[Any, Any]) -> int:
    i = n = 0
    while i + 2 <= calls.size:
        i += 2 + int(calls[i + 1])
        n += 1
    return n
