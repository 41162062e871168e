"""torch's elementwise functions on the CPU with one formula for every value, so that a
value's activation does not depend on the tensor it sits in.

Why: torch's CPU loops run whole vectors (two vectors a step: at most 64 values, bf16 on
AVX-512) and finish each thread's share of a call with a scalar formula, whose
transcendentals (libm's exp and tanh against the vector ones) differ in their last bits.
Which values fall in those tails depends on the tensor's size and on how the call is
split among threads, so a row's SiLU or GELU moved with the rows beside it in a step.
`vectorwise` hands torch only calls that its vector loop covers exactly on one thread:
pieces of whole 64-value spans, as large as torch runs unsplit (below its grain of 32768
values for most ops; the tanh GELU splits calls of more than 6144), the last span padded
with zeros. Every value then takes the vector formula, whatever the step holds.
Off the CPU the function runs as it is: a GPU's elementwise kernel applies one formula
to every element.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

SPAN = 64  # values per step of torch's widest vector loop (two AVX-512 vectors of bf16)
GRAIN = 32768  # torch's at::internal::GRAIN_SIZE: calls of fewer values run on one thread


def vectorwise(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, serial_values: int = GRAIN - 1
) -> torch.Tensor:
    """fn(x) for an elementwise `fn` that keeps shape and dtype, every value of a CPU
    tensor by torch's vector formula (see the module docstring); `serial_values`: the
    most values torch runs a call of `fn` with on one thread."""
    n = x.numel()
    if not x.is_cpu or n == 0:
        return fn(x)
    flat = x.reshape(-1)
    if n % SPAN:
        flat = F.pad(flat, (0, SPAN - n % SPAN))
    piece = serial_values // SPAN * SPAN
    pieces = [fn(flat[start : start + piece]) for start in range(0, flat.numel(), piece)]
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return out[:n].view(x.shape)
