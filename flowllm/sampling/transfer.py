"""A step's small host values (row indices, parameters) to the logits' device, unwaited.

A blocking host-to-device copy (`torch.tensor(values, device="cuda")`) first waits for every
kernel queued before it, so each one would stall the step's pipeline. The sampler moves its
per-step lists with `to_device`, an asynchronous copy, so a step's kernels queue back to back
and the host waits for the device once, when the step's tokens come back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(
    values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """`values` as a 1-D tensor of `dtype` on `device`, copied without waiting for it."""
    return moved(torch.tensor(values, dtype=dtype), device)


def moved(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` (itself on the CPU), copied without waiting for it."""
    return t if t.device == device else t.to(device, non_blocking=True)
