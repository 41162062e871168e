"""The heap trim after a burst: once the engine has gone idle and stayed idle for
`IDLE_SECONDS`, glibc's heap gives back what the burst's steps freed (`glibc_heap.trim`).

Why the wait: a trim costs its own run and, after it, page faults for the next steps that
grow the heap again. An engine serving a steady trickle of requests, with gaps under a
second, never trims; one left idle trims once, a second after its last step. No timer
runs while the engine works or after the trim: the wait is a deadline on the execute
stage's wait for its next step (`receive`), set only when a step ran since the last trim.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import anyio.to_thread

from flowllm.models import glibc_heap

IDLE_SECONDS = 1.0
T = TypeVar("T")


class IdleHeapTrim:
    """Owned by execute, whose model runner keeps the freed heap mapped."""

    def __init__(
        self, idle_seconds: float = IDLE_SECONDS, trim: Callable[[], object] = glibc_heap.trim
    ) -> None:
        if idle_seconds < 0:
            raise ValueError(f"idle_seconds must be at least 0, got {idle_seconds}")
        self.idle_seconds = idle_seconds
        self._trim = trim
        self._due = False  # the engine worked since the last trim

    def worked(self) -> None:
        """The engine ran a step: the next idle period trims."""
        self._due = True

    async def receive(self, receive: Callable[[], Awaitable[T]]) -> T:
        """`receive()` while the engine is idle: if work ran since the last trim and nothing
        arrives within `idle_seconds`, trim (in a worker thread) and wait on."""
        if self._due:
            with anyio.move_on_after(self.idle_seconds):
                return await receive()
            self._due = False
            await anyio.to_thread.run_sync(self._trim)
        return await receive()
