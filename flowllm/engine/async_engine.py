"""The running engine: the stage graph plus the model it serves, as an EngineClient.

`AsyncEngine.start(config)` is an async context manager: it loads the model (once), builds
the graph from YAML (the default one unless told otherwise) and runs it for the body;
leaving the body stops intake, drains in-flight requests up to `stop_timeout`, then
cancels. The HTTP lifespan and the offline `LLM` both use it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from flowllm import openmp
from flowllm.config import EngineConfig, RequestLimits
from flowllm.engine import DEFAULT_GRAPH as DEFAULT_GRAPH  # where its users import it from
from flowllm.graph.runtime import Graph
from flowllm.graph.spans import SpanSink
from flowllm.graph.validator import ValidGraph
from flowllm.mailbox import Mailbox, Overloaded
from flowllm.messages import GenerateRequest
from flowllm.models.pooler_config import PoolerConfig
from flowllm.stages.guide import has_guide
from flowllm.stages.ingest import Ingest
from flowllm.stages.services import EngineServices

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from transformers import PreTrainedTokenizerBase

    from flowllm.traces.recorder import TraceRecorder


class AsyncEngine:
    """A started graph seen from outside (implements flowllm.engine.client.EngineClient)."""

    def __init__(self, graph: Graph, services: EngineServices) -> None:
        self.graph = graph
        self.services = services
        ingest = graph.stage("ingest")
        if not isinstance(ingest, Ingest):
            raise TypeError(f"the graph's 'ingest' stage must be an Ingest, not {ingest!r}")
        self._ingest = ingest

    @classmethod
    @asynccontextmanager
    async def start(
        cls,
        config: EngineConfig | None = None,
        *,
        graph: ValidGraph | str | Path | None = None,
        services: EngineServices | None = None,
        stop_timeout: float = 30.0,
        recorder: TraceRecorder | None = None,
        span_sinks: Sequence[SpanSink] = (),
        **graph_options: Any,
    ) -> AsyncIterator[AsyncEngine]:
        """Run an engine for the body. Pass `services` to reuse an already loaded model,
        `recorder` to record the run's channel traffic (closed when the graph has ended),
        `span_sinks` to hand every stage span to (OpenTelemetry export). Where the model
        runs in this process, the loop's thread runs its torch work on one OpenMP thread for
        the body (flowllm/openmp.py)."""
        if services is None:
            from flowllm.engine.loading import build_services  # torch: a front passes its own

            services = build_services(config or EngineConfig())
        with openmp.one_thread() if services.device is not None else nullcontext():
            runtime = Graph(
                graph or DEFAULT_GRAPH,
                services,
                registry=services.registry,
                fail_request=services.mailboxes.fail,
                **graph_options,
            )
            services.guided = has_guide(runtime.spec)
            for sink in span_sinks:
                runtime.span_sinks.add(sink)
            if recorder is None:
                async with runtime.serve(stop_timeout) as running:
                    yield cls(running, services)
                return
            recorder.attach(runtime, services)
            try:
                async with runtime.serve(stop_timeout) as running:
                    yield cls(running, services)
            finally:
                await anyio.to_thread.run_sync(recorder.close)

    # -- EngineClient ---------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.services.served_model_name

    @property
    def max_model_len(self) -> int:
        return self.services.max_model_len

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.services.tokenizer

    @property
    def healthy(self) -> bool:
        return self.graph.healthy

    @property
    def accepting(self) -> bool:
        return self.graph.running and not self.graph.failed

    @property
    def full(self) -> bool:
        return self._ingest.full

    @property
    def metrics_registry(self) -> CollectorRegistry:
        return self.services.registry

    @property
    def limits(self) -> RequestLimits:
        return self.services.config.limits

    @property
    def pooler(self) -> PoolerConfig | None:
        return self.services.pooler

    def submit(self, request: GenerateRequest) -> Mailbox:
        return self._ingest.submit(request)

    def submit_all(self, requests: Sequence[GenerateRequest]) -> list[Mailbox]:
        return self._ingest.submit_all(requests)

    async def submit_when_admitted(self, request: GenerateRequest) -> Mailbox:
        """Submit, waiting while admission is full (offline callers queue); a request that
        could never be admitted raises RequestFailed."""
        while True:
            try:
                return self.submit(request)
            except Overloaded:
                await anyio.sleep(0.005)

    def abort(self, request_id: str) -> None:
        self._ingest.abort(request_id)
