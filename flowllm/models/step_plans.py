"""Decode steps replayed from recorded kernel calls (`flowllm.kernels.call_plan`), one plan
per step shape.

A decode-only step (one query per sequence) of a given number of sequences and block-table
width makes the same native calls on the same buffers every time. The runner records a
model's layers for such a shape the second time it sees it (a shape seen once may never
come back, and recording costs an eager step) and replays the plan from then on, which
removes the Python of every layer (benchmarks/README.md, "Model step"). Everything else in
the step (embedding, logits, input building) stays eager.

Memory: a plan keeps its activations, ~17 KB a layer and sequence for SmolLM2 in bf16
(~130 MB at 256 sequences). Plans beyond `memory_limit` bytes are dropped, least recently
used first; a shape whose plan alone exceeds it stays eager.

A model whose layers run torch ops (GPT-2's LayerNorm and residual adds; any model where
the native kernels do not serve a dtype) cannot be recorded: the first refusal is logged
once and the runner stays eager. `enforce_eager` (as vLLM's flag) never records.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

import structlog
import torch

from flowllm.kernels import call_plan
from flowllm.kernels.native import NativeLibrary

DEFAULT_MEMORY_LIMIT = 256 * 1024**2

_log = structlog.get_logger("flowllm.models")

Outputs = call_plan.Outputs


class StepPlans:
    """Recorded plans by step key; `run` replays, records or runs eagerly."""

    def __init__(self, lib: NativeLibrary, memory_limit: int = DEFAULT_MEMORY_LIMIT) -> None:
        self.lib = lib
        self.memory_limit = memory_limit
        self.plans: OrderedDict[Hashable, call_plan.CallPlan] = OrderedDict()
        self.refused: str | None = None  # why the model cannot be recorded, once known
        self._seen: set[Hashable] = set()
        self._too_large: set[Hashable] = set()

    @property
    def nbytes(self) -> int:
        """What the kept plans' temporaries hold."""
        return sum(p.nbytes for p in self.plans.values())

    def run(
        self, key: Hashable, fn: Callable[..., Outputs], inputs: Sequence[torch.Tensor]
    ) -> Outputs:
        """fn(*inputs), from the plan recorded for `key` where there is one. The outputs of a
        replay are the plan's tensors: read them before the next step."""
        plan = self.plans.get(key)
        if plan is not None:
            self.plans.move_to_end(key)
            out = plan.replay(inputs)
            if out is not None:
                return out
            # A kernel refused these inputs' values: the eager run raises its error, or,
            # when the model changed under the plan (a table grown), succeeds without it.
            del self.plans[key]
            return fn(*inputs)
        if self.refused is not None or key in self._too_large or key not in self._seen:
            self._seen.add(key)
            return fn(*inputs)
        recorded = call_plan.record(self.lib, fn, inputs)
        plan = recorded.plan
        if plan is None:
            self.refused = recorded.refused
            _log.info("step_plans_off", reason=f"the layers cannot be replayed: {self.refused}")
        elif plan.nbytes > self.memory_limit:
            self._too_large.add(key)
        else:
            self.plans[key] = plan
            while self.nbytes > self.memory_limit:
                self.plans.popitem(last=False)
            _log.debug("step_plan_recorded", key=key, calls=plan.num_calls, nbytes=plan.nbytes)
        return recorded.outputs
