"""What a backend of `flowllm.models.step_plans` gives: a step's layers recorded into a
plan that replays them (native kernel calls on CPU, `flowllm.kernels.call_plan`; CUDA
graphs, `flowllm.models.cuda_graphs`), or why it could not record them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from flowllm.kernels import call_plan

Outputs = call_plan.Outputs


class Plan(Protocol):
    """A recorded step: `replay` gives `fn(*inputs)`'s outputs (the plan's own tensors,
    valid until the next replay), or None when a kernel refused the inputs' values."""

    nbytes: int

    def replay(self, inputs: Sequence[torch.Tensor]) -> Outputs | None: ...


@dataclass(frozen=True)
class Recorded:
    """What a backend's `record` ran: `fn`'s outputs, and its plan or why there is none."""

    outputs: Outputs
    plan: Plan | None
    refused: str | None = None


class Backend(Protocol):
    """Records `fn(*inputs)` into a plan (running it once), whose static inputs are copies
    of `inputs`."""

    def record(self, fn: Callable[..., Outputs], inputs: Sequence[torch.Tensor]) -> Recorded: ...
