"""The heap trim after a burst: once the engine has gone idle and stayed idle for
`IDLE_SECONDS`, glibc's heap gives back what the burst's steps freed (`glibc_heap.trim`).

Why the wait: a trim costs its own run and, after it, page faults for the next steps that
grow the heap again. An engine serving a steady trickle of requests, with gaps under a
second, never trims; one left idle trims once, a second after its last step.

Why a timer on the loop rather than a deadline on the stage's wait for its next step: a
deadline is a cancel scope per step, a cost on every step, where a step here costs one
clock read. The timer is armed by the first step after a trim and fires at most once per
`IDLE_SECONDS` while steps keep coming (each time it finds a later step, it waits again
from that one); no timer runs once it has trimmed, until the next step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from flowllm.models import glibc_heap

IDLE_SECONDS = 1.0


class IdleHeapTrim:
    """Owned by execute, whose model runner keeps the freed heap mapped: `stepping()` as a
    step starts, `stepped()` as it ends. Runs on the stage's event loop (asyncio)."""

    def __init__(
        self, idle_seconds: float = IDLE_SECONDS, trim: Callable[[], object] = glibc_heap.trim
    ) -> None:
        if idle_seconds < 0:
            raise ValueError(f"idle_seconds must be at least 0, got {idle_seconds}")
        self.idle_seconds = idle_seconds
        self._trim = trim
        self._last_step = 0.0  # time.monotonic() when the latest step ended
        self._in_step = False
        self._timer: asyncio.TimerHandle | None = None  # armed: a step ran since the trim

    def stepping(self) -> None:
        self._in_step = True

    def stepped(self) -> None:
        self._in_step = False
        self._last_step = time.monotonic()
        if self._timer is None:
            self._arm(self.idle_seconds)

    def close(self) -> None:
        """The stage ends: no trim is due any more."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self, delay: float) -> None:
        self._timer = asyncio.get_running_loop().call_later(delay, self._check)

    def _check(self) -> None:
        """Trim (in a thread, off the loop) if no step ran for `idle_seconds`, else wait
        until that long after the latest one."""
        wait = self._last_step + self.idle_seconds - time.monotonic()
        if self._in_step or wait > 0:
            self._arm(max(wait, 0.0) if not self._in_step else self.idle_seconds)
            return
        self._timer = None
        asyncio.get_running_loop().run_in_executor(None, self._trim)
