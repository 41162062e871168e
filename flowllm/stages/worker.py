"""Worker threads for the stages that run torch work every step (execute, sample).

`anyio.to_thread.run_sync` hands each call to a pooled thread through a capacity limiter
and a cancel scope, and successive calls may land on different pool threads (each with its
own OpenMP team for torch); at one call per step that machinery shows in the step time
(benchmarks/README.md, "Pipeline overhead"). So such a stage keeps a thread of its own
(`EngineServices.worker_thread`): a call is one queue put there and one
`call_soon_threadsafe` back. The thread lives as long as the model's services, not one
graph run, so that every run's steps get the same warm thread and OpenMP team.

A caller cancelled while its call runs stops waiting at once, without a shielding cancel
scope per call (which costs a noticeable share of a step); the call runs to its end and
its result is dropped. The thread runs calls in order, so the next graph run's first step cannot
touch the KV cache before that call is done. The graph runs on anyio's asyncio backend,
which this relies on.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_Job = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[..., Any], tuple[Any, ...]]


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def _serve(jobs: queue.SimpleQueue[_Job | None]) -> None:
    """The thread: run jobs in order until the stop sentinel (None)."""
    while (job := jobs.get()) is not None:
        loop, future, fn, args = job
        result, error = None, None
        try:
            result = fn(*args)
        except BaseException as e:  # handed to the caller, as anyio does
            error = e
        # RuntimeError: the loop closed meanwhile, so nobody waits for the result
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_settle, future, result, error)


# Every started thread and its queue, to stop them at exit: a thread that ran torch work
# and is still alive while the interpreter finalizes can abort the process ("terminate
# called without an active exception" from a C++ thread pool's destructor).
_running: weakref.WeakKeyDictionary[threading.Thread, queue.SimpleQueue[_Job | None]] = (
    weakref.WeakKeyDictionary()
)
_EXIT_JOIN_SECONDS = 5.0


@atexit.register
def _stop_all() -> None:
    threads = list(_running.items())
    for _, jobs in threads:
        jobs.put(None)
    for thread, _ in threads:
        thread.join(_EXIT_JOIN_SECONDS)


class WorkerThread:
    """One thread running calls in order, started at the first call; it stops at `close`
    or when this object is collected."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[_Job | None] | None = None
        self._thread: threading.Thread | None = None

    def _start(self) -> queue.SimpleQueue[_Job | None]:
        jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=_serve, args=(jobs,), name=self.name, daemon=True)
        self._thread.start()
        weakref.finalize(self, jobs.put, None)
        _running[self._thread] = jobs
        self._jobs = jobs
        return jobs

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in this thread; its result or exception."""
        jobs = self._jobs or self._start()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        jobs.put((loop, future, fn, args))
        return await future

    def close(self) -> None:
        """Stop the thread once the calls already queued have run."""
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = None
