"""Scratch buffers that one model runner reuses from step to step.

A CPU step's largest temporaries are the decode attention's gathered K/V (at batch 256 ×
context 192, GPT-2 shape, float32: 151 MB each, per layer). Allocated fresh on a worker
thread they cost page faults every step: glibc serves a block larger than a thread arena's
64 MiB heap from a fresh mapping and unmaps it on free, whatever `mallopt` says
(benchmarks/README.md "Kernel design figures").
"""

from __future__ import annotations

import math

import torch

_GROWTH = 1.25  # headroom on regrowth, so a slowly growing batch does not reallocate each step


class Workspace:
    """Named flat buffers, grown on demand and handed out as views of the requested shape.

    A view is valid until the next `get` of the same name: the layers of a step run one
    after another, so each layer's attention reuses what the previous one left.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """An uninitialised tensor of `shape`, backed by the buffer called `name`."""
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.device != device or buf.numel() < numel:
            buf = torch.empty(int(numel * _GROWTH) + 1, dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf[:numel].view(shape)

    def nbytes(self) -> int:
        """Bytes held, for logs and tests."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
