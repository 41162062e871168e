"""torch's elementwise functions on the CPU with one formula for every value, so that a
value's activation does not depend on the tensor it sits in.

Why: torch's CPU loops run whole vectors (two vectors a step: at most 64 values, bf16 on
AVX-512) and finish each thread's share of a call with a scalar formula, whose
transcendentals (libm's exp and tanh against the vector ones) differ in their last bits.
Which values fall in those tails depends on the tensor's size and on how the call is
split among threads, so a row's SiLU or GELU moved with the rows beside it in a step.
`vectorwise` hands torch only calls that its vector loop covers exactly on one thread:
pieces of whole 64-value spans, small enough that torch runs them unsplit (the tanh GELU
splits calls of more than 6144 values among threads, SiLU from 32768), the last span
padded with zeros. Every value then takes the vector formula, whatever the step holds.
Off the CPU the function runs as it is: a GPU's elementwise kernel applies one formula
to every element.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

SPAN = 64  # values per step of torch's widest vector loop (two AVX-512 vectors of bf16)
PIECE = 4096  # values per call: whole spans, below every CPU op's threading threshold


def vectorwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise `fn` that keeps shape and dtype, every value of a CPU
    tensor by torch's vector formula (see the module docstring)."""
    n = x.numel()
    if not x.is_cpu or n == 0:
        return fn(x)
    flat = x.reshape(-1)
    if n % SPAN:
        flat = F.pad(flat, (0, SPAN - n % SPAN))
    pieces = [fn(flat[start : start + PIECE]) for start in range(0, flat.numel(), PIECE)]
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return out[:n].view(x.shape)
