"""How a model step's layers run: eagerly, or replayed from a plan recorded for the step's
shape. This is the one place that decides, for every device.

A decode-only step (one query per sequence) of a given shape makes the same kernel calls on
the same buffers every time, only its inputs' values change. Two backends record such a
step's layers into a plan and replay it, which removes the Python of every layer:

- CPU: the native kernel calls (`flowllm.kernels.call_plan`). A plan per exact shape
  (number of sequences, block-table width), recorded the second time the shape is seen (a
  shape seen once may never come back, and recording costs an eager step), kept within
  `memory_limit` (benchmarks/README.md, "Model step").
- CUDA: CUDA graphs (`flowllm.models.cuda_graphs`), one per capture size, all captured at
  start-up (`capture`), a step padded to the smallest size that holds it
  (`flowllm.models.decode_buckets`). A larger step runs eagerly, as do prefills and mixed
  steps.

Everything else in the step (embedding, logits, input building) stays eager.

CPU memory: a plan keeps its activations, ~17 KB a layer and sequence for SmolLM2 in bf16
(~130 MB at 256 sequences). Plans beyond `memory_limit` bytes are dropped, least recently
used first; a shape whose plan alone exceeds it stays eager.

A model whose layers cannot be recorded (on CPU: torch ops in its layers, as GPT-2's
LayerNorm, or a dtype the native kernels do not serve; anywhere: a decision on a tensor's
values, as a mixture of experts' routing) stays eager, the first refusal logged once.
`enforce_eager` (as vLLM's flag) never records.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import structlog
import torch

from flowllm.kernels import call_plan
from flowllm.kernels.native import NativeLibrary
from flowllm.kernels.workspace import Workspace
from flowllm.models import cuda_graphs
from flowllm.models.context import AttentionContext
from flowllm.models.decode_buckets import DecodeBuckets, LayerInputs
from flowllm.models.plan_backend import Backend, Outputs, Plan, Recorded

if TYPE_CHECKING:
    from flowllm.models.runner import KVCaches, StepModel

DEFAULT_MEMORY_LIMIT = 256 * 1024**2

_log = structlog.get_logger("flowllm.models")


class NativeCalls:
    """The CPU backend: plans of native kernel calls (of the active build)."""

    def record(self, fn: Callable[..., Outputs], inputs: Sequence[torch.Tensor]) -> Recorded:
        recorded = call_plan.record(fn, inputs)
        return Recorded(recorded.outputs, recorded.plan, recorded.refused)


def for_device(
    model: StepModel,
    kv_caches: KVCaches,
    device: torch.device,
    native: NativeLibrary | None,
    buckets: DecodeBuckets | None,
) -> StepPlans | None:
    """The plans of a model runner on `device`: native call plans where the CPU kernels
    load, CUDA graphs of `buckets`' sizes on CUDA; None (every step eager) elsewhere, and
    for a model without a KV cache (an encoder)."""
    if native is not None:
        return StepPlans(model, kv_caches, NativeCalls())
    if device.type == "cuda" and buckets is not None and buckets.sizes and kv_caches:
        backend = cuda_graphs.GraphBackend(buckets, cuda_graphs.CudaCapture(device))
        return StepPlans(model, kv_caches, backend, buckets)
    return None


def layer_inputs(h: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> LayerInputs:
    """What a plan of a step's layers reads: every tensor they are called with."""
    return (h, positions, ctx.slot_mapping, ctx.block_tables, ctx.query_start_loc, ctx.seq_lens)


class StepPlans:
    """A model's recorded decode steps by key, and the decision of how each step runs."""

    def __init__(
        self,
        model: StepModel,
        kv_caches: KVCaches,
        backend: Backend,
        buckets: DecodeBuckets | None = None,
        memory_limit: int = DEFAULT_MEMORY_LIMIT,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.buckets = buckets  # None: a plan per exact shape, recorded as they come
        self.memory_limit = memory_limit
        self.plans: OrderedDict[Hashable, Plan] = OrderedDict()
        self.refused: str | None = None  # why the model cannot be recorded, once known
        self._seen: set[Hashable] = set()
        self._too_large: set[Hashable] = set()

    @property
    def nbytes(self) -> int:
        """What the kept plans' temporaries hold."""
        return sum(p.nbytes for p in self.plans.values())

    def forward_layers(
        self, h: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> tuple[torch.Tensor, ...]:
        """The model's `forward_layers` over a step: a decode step's from its plan where
        there is one (see module); every other step eagerly. A plan's outputs are read
        before the next step."""
        if ctx.max_query_len != 1 or self.refused is not None:
            return self.model.forward_layers(h, positions, self.kv_caches, ctx)
        inputs = layer_inputs(h, positions, ctx)
        if self.buckets is None:  # every Python decision in the layers follows these
            key = (h.shape, h.dtype, ctx.block_tables.shape)
            return self.run(key, self._layers(ctx), inputs)
        rows = self.buckets.rows_for(*ctx.block_tables.shape)
        plan = None if rows is None else self.plans.get(self._bucket_key(rows, h))
        out = None if plan is None else plan.replay(inputs)
        if out is None:
            return self.model.forward_layers(h, positions, self.kv_caches, ctx)
        return out

    def run(
        self, key: Hashable, fn: Callable[..., Outputs], inputs: Sequence[torch.Tensor]
    ) -> Outputs:
        """fn(*inputs), from the plan recorded for `key` where there is one, else recorded
        the second time `key` comes."""
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
        recorded = self.backend.record(fn, inputs)
        plan = recorded.plan
        if plan is None:
            self._refuse(recorded.refused)
        elif plan.nbytes > self.memory_limit:
            self._too_large.add(key)
        else:
            self.plans[key] = plan
            while self.nbytes > self.memory_limit:
                self.plans.popitem(last=False)
            _log.debug("step_plan_recorded", key=key, nbytes=plan.nbytes)
        return recorded.outputs

    def capture(self, workspace: Workspace | None = None) -> int:
        """Record every bucket's plan, largest first (so the graphs' shared pool is sized
        once), on padding rows; how many were recorded (none once refused)."""
        if self.buckets is None:
            raise ValueError("plans recorded per exact shape are recorded as steps come")
        device = self.kv_caches[0][0].device
        for rows in sorted(self.buckets.sizes, reverse=True):
            zeros = torch.zeros(rows, dtype=torch.int64, device=device)
            static = self.buckets.padding(self.model.embed(zeros, zeros))
            none = zeros[:0]
            ctx = AttentionContext(
                slot_mapping=static[2], block_tables=static[3], query_start_loc=static[4],
                seq_lens=static[5], logits_indices=none, max_query_len=1,
                max_seq_len=self.buckets.max_seq_len, workspace=workspace,
            )  # fmt: skip
            recorded = self.backend.record(self._layers(ctx), static)
            if recorded.plan is None:
                self._refuse(recorded.refused)
                self.plans.clear()
                return 0
            self.plans[self._bucket_key(rows, static[0])] = recorded.plan
        return len(self.plans)

    def _layers(self, ctx: AttentionContext) -> Callable[..., Outputs]:
        """The model's layers as a function of `layer_inputs`, under `ctx`'s bounds."""

        def layers(*t: torch.Tensor) -> Outputs:
            static = replace(ctx, slot_mapping=t[2], block_tables=t[3], query_start_loc=t[4],
                             seq_lens=t[5])  # fmt: skip
            return self.model.forward_layers(t[0], t[1], self.kv_caches, static)

        return layers

    def _bucket_key(self, rows: int, h: torch.Tensor) -> Hashable:
        assert self.buckets is not None
        return (torch.Size((rows, *h.shape[1:])), h.dtype, torch.Size((rows, self.buckets.width)))

    def _refuse(self, why: str | None) -> None:
        self.refused = why
        _log.info("step_plans_off", reason=f"the layers cannot be replayed: {why}")
