"""An engine replica: a Ray Serve replica that is an engine core (flowllm/engine/core.py).

It runs the core's part of the placed graph (the step loop and the model) and listens on
TCP, on its node's address and a free port, for one front: the ingress's front for this
replica (flowllm/scale_out/ingress.py), which speaks the wire format of every
cross-process channel (flowllm/graph/wire.py) and must hold the replica's token. Serve
calls `describe` for the address (the ingress asks again after a restart) and
`check_health`: a core whose graph failed for good raises, and Serve replaces the
replica. The core runs in a task of the replica's event loop for the replica's whole
life (its task group must be entered and left in one task).
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

import anyio
import anyio.to_thread

from flowllm.engine.core import Core, CoreSpec
from flowllm.graph.transport import tcp_address

DRAIN_POLL_S = 0.05


class EngineReplica:
    """One data-parallel engine core: `args` are `flowllm serve`'s, `threads` torch's
    threads, `token` what its front's greeting must carry."""

    async def __init__(self, args: argparse.Namespace, threads: int, token: str) -> None:  # type: ignore[misc]
        import ray
        import torch

        from flowllm.engine import graph_for_task
        from flowllm.engine.args import config_from_args
        from flowllm.engine.loading import build_services
        from flowllm.graph.validator import load_graph
        from flowllm.logging_config import configure_logging

        configure_logging(fmt=args.log_format, level=args.log_level, force=True)
        torch.set_num_threads(threads)
        graph = load_graph(
            args.graph or graph_for_task(args.task, args.speculative_config is not None)
        )
        config = config_from_args(args)
        services = await anyio.to_thread.run_sync(build_services, config)
        spec = CoreSpec(
            config=config,
            graph_file=graph.spec.source,
            address=tcp_address(ray.util.get_node_ip_address(), 0),
            fronts=1,
            token=token,
            stop_timeout=args.shutdown_timeout,
        )
        self._core = Core(spec, graph, services)
        self._stop_timeout = args.shutdown_timeout
        started: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._runner = asyncio.create_task(self._run(started))
        self._address = await started

    async def _run(self, started: asyncio.Future[str]) -> None:
        try:
            async with anyio.create_task_group() as tg:
                started.set_result(await tg.start(self._core.serve))
        except BaseException as exc:
            if not started.done():
                started.set_exception(exc)
            raise

    def describe(self) -> dict[str, Any]:
        """Where the core listens, its process, and the stages it runs."""
        return {
            "address": self._address,
            "pid": os.getpid(),
            "stages": list(self._core.graph.stages_here),
        }

    def check_health(self) -> None:
        """Serve's health check: a core whose graph failed for good is replaced."""
        if self._runner.done() or not self._core.serving:
            raise RuntimeError("the engine replica's core has stopped")

    async def __del__(self) -> None:
        """Serve stops the replica: the requests running here finish first (up to
        --shutdown-timeout; the ingress, stopping meanwhile, waits for them too), then the
        core's graph drains."""
        with anyio.move_on_after(self._stop_timeout):
            while self._core.busy and self._core.serving:
                await anyio.sleep(DRAIN_POLL_S)
        self._core.stop()
        await asyncio.shield(self._runner)
