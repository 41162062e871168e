"""The CUDA backend of `flowllm.models.step_plans`: a decode step's layers captured as a
CUDA graph per capture size, replayed with the step's inputs padded into the graph's
(`flowllm.models.decode_buckets`).

A graph replays every kernel launch of the layers (~110 for GPT-2 124M) as one, removing
the Python between them, which bounds a decode step on a GPU. What capture cannot hold is
refused before it is tried: a function that reads a tensor's values into Python (a
mixture of experts picks its experts so) would keep the choice of its warm-up run. All
graphs share one memory pool: a step reads its outputs before the next step replays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from flowllm.kernels import call_plan
from flowllm.models.decode_buckets import DecodeBuckets, LayerInputs
from flowllm.models.plan_backend import Outputs, Recorded


class Graph(Protocol):
    """What a plan replays: a captured `torch.cuda.CUDAGraph` (the tests' stand-in reruns
    the function on CPU)."""

    def replay(self) -> None: ...


# capture(fn, static inputs) -> (the graph of fn over them, the outputs it writes)
Capture = Callable[[Callable[..., Outputs], LayerInputs], tuple[Graph, Outputs]]


class GraphPlan:
    """A graph over static layer inputs of one capture size, and the outputs it writes."""

    nbytes = 0  # the graphs' memory is their shared pool's, measured at start-up

    def __init__(
        self, graph: Graph, inputs: LayerInputs, outputs: Outputs, buckets: DecodeBuckets
    ) -> None:
        self.graph = graph
        self.inputs = inputs
        self.outputs = outputs
        self.buckets = buckets

    def replay(self, inputs: Sequence[torch.Tensor]) -> Outputs:
        """The outputs' rows of `inputs`' sequences: views of the graph's outputs, which
        the next replay overwrites."""
        self.buckets.pad_into(self.inputs, tuple(inputs))
        self.graph.replay()
        n = inputs[0].shape[0]
        return tuple(o[:n] for o in self.outputs)


class GraphBackend:
    """Records a function of padded layer inputs as a graph (`plan_backend.Backend`)."""

    def __init__(self, buckets: DecodeBuckets, capture: Capture) -> None:
        self.buckets = buckets
        self.capture = capture

    def record(self, fn: Callable[..., Outputs], inputs: Sequence[torch.Tensor]) -> Recorded:
        """Run `fn(*inputs)` once eagerly (which compiles every Triton kernel it launches
        and grows any table it needs), then capture it over copies of `inputs`, the plan's
        static inputs."""
        static = tuple(t.clone() for t in inputs)
        reads = call_plan.ValueReads()
        with reads:
            outputs = fn(*static)
        if reads.refused is not None:
            return Recorded(outputs, None, f"it reads values into Python ({reads.refused})")
        try:
            graph, outputs = self.capture(fn, static)
        except RuntimeError as exc:  # an op capture does not allow
            return Recorded(outputs, None, f"its capture failed ({exc})")
        return Recorded(outputs, GraphPlan(graph, static, outputs, self.buckets))


class CudaCapture:
    """Captures CUDA graphs on one device, all in one memory pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, fn: Callable[..., Outputs], static: LayerInputs) -> tuple[Graph, Outputs]:
        with torch.cuda.device(self.device):
            torch.cuda.synchronize()  # the warm-up run's work done before capture starts
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = fn(*static)
        return graph, outputs
