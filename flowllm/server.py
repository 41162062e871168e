"""The uvicorn server behind `flowllm serve`, and how it stops.

- The first SIGTERM or SIGINT stops admission (503 with Retry-After) and lets requests in
  flight finish for up to the shutdown timeout; those still running then get a 503 (the
  graph fails them with `GraphStoppedError`), so every client gets an answer before the
  connections close. uvicorn's own deadline, a little later, only catches stragglers.
- A second signal of either kind answers what is in flight with a 503 at once and exits.
- A failure the graph escalates stops the server: the process exits with
  `EXIT_ENGINE_FAILED` so that its process manager starts it again.

Over plain HTTP, connections are accepted by a process of its own (`health_fast_path`),
which answers probes itself and passes the rest to the event loop; every tick of the loop
publishes the engine's health to it.
"""

from __future__ import annotations

import asyncio
import functools
import socket
from types import FrameType
from typing import Any

import structlog
import uvicorn

from flowllm.engine.async_engine import AsyncEngine
from flowllm.health_fast_path import HealthDoorProcess

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
        self._door: HealthDoorProcess | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.config.ssl is not None or not self.started:
            return
        loop = asyncio.get_running_loop()
        listeners = []
        for server in self.servers:
            for bound in server.sockets:
                loop.remove_reader(bound.fileno())  # from now on the door accepts
                listeners.append(socket.fromfd(bound.fileno(), bound.family, bound.type))
        self._door = HealthDoorProcess(listeners, self._adopt)
        self._door.start(loop)

    def _adopt(self, conn: socket.socket) -> None:
        self._spawn(self._serve_connection(conn))

    async def _serve_connection(self, conn: socket.socket) -> None:
        """Serve a connection the fast path accepted, as if the loop had accepted it."""
        # uvicorn declares http_protocol_class a bare asyncio.Protocol; its classes take these.
        protocol = functools.partial(  # type: ignore[call-arg]
            self.config.http_protocol_class,
            config=self.config,
            server_state=self.server_state,
            app_state=self.lifespan.state,
        )
        try:
            await asyncio.get_running_loop().connect_accepted_socket(protocol, conn)
        except OSError:
            conn.close()

    async def on_tick(self, counter: int) -> bool:
        if self._door is not None:
            self._door.publish(self.engine is not None and self.engine.healthy)
        return await super().on_tick(counter)

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
        if self._door is not None:
            self._door.stop()
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
