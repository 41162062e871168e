"""The uvicorn server behind `flowllm serve`, and how it stops.

- The first SIGTERM or SIGINT stops admission (503 with Retry-After) and lets requests in
  flight finish for up to the shutdown timeout; those still running then get a 503 (the
  graph fails them with `GraphStoppedError`), so every client gets an answer before the
  connections close. uvicorn's own deadline, a little later, only catches stragglers.
- A second signal of either kind answers what is in flight with a 503 at once and exits.
- A failure the graph escalates stops the server: the process exits with
  `EXIT_ENGINE_FAILED` so that its process manager starts it again.

A front process of a placed graph runs this server over its share of the listening
socket; `/health` reads the front's engine, which knows the core's heartbeat.
"""

from __future__ import annotations

import asyncio
import socket
from types import FrameType
from typing import Any

import structlog
import uvicorn

from flowllm.engine.async_engine import AsyncEngine

# sysexits' EX_SOFTWARE: the engine failed past its supervision; start the process again.
EXIT_ENGINE_FAILED = 70
# After a second signal, how long in-flight requests get to write their 503 before exit.
ABANDON_GRACE_S = 0.5
# uvicorn's deadline for connections, past the graph's drain: time to write the answers.
CONNECTION_GRACE_S = 2.0


class GracefulServer(uvicorn.Server):
    """A uvicorn server that drains the engine's graph itself (see the module doc)."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout: float) -> None:
        config.timeout_graceful_shutdown = int(shutdown_timeout + CONNECTION_GRACE_S)
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout
        self.engine: AsyncEngine | None = None  # set by the lifespan once it runs
        self.escalated = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and self._loop is not None:
            # A second signal, SIGTERM as well as SIGINT: answer and go.
            self._loop.call_soon_threadsafe(self._abandon)
            self._loop.call_later(ABANDON_GRACE_S, setattr, self, "force_exit", True)
        super().handle_exit(sig, frame)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _abandon(self) -> None:
        if self.engine is not None:
            self._spawn(self.engine.graph.stop(0.0))

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.engine is not None:
            self._spawn(self.engine.graph.stop(self.shutdown_timeout))
        await super().shutdown(sockets)

    async def exit_when_failed(self, engine: AsyncEngine) -> None:
        """An escalated failure ends the graph: stop serving, so the process exits."""
        await engine.graph.wait_finished()
        if engine.graph.failed:
            self.escalated = True
            structlog.get_logger("flowllm.serve").error(
                "the engine failed; exiting so that it can be restarted"
            )
            self.should_exit = True
