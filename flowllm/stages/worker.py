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

A hop to the thread and back costs two thread wake-ups, which can be more than a small
step's whole work (an instant model's or a replayed GPU step's host work;
benchmarks/README.md, "Calls that run on the loop", has the figures). So a call that names
its size class (`size`) runs on the caller's thread instead when the last call of that
class took at most `INLINE_BUDGET_S` and the thread has nothing queued or running: a short
call blocks the loop for less than the hop would have cost, and never overlaps a call in
the thread. A class not seen yet, or slower, goes to the thread, so a long step (a real
model's on CPU, a prefill) never blocks the loop.

Each thread sizes its OpenMP pool at its start (`pool_threads`): one thread, except for the
thread that runs the model's steps (flowllm/openmp.py). It gives itself its name in
the OS too, which the pool's threads inherit, so `top -H` shows whose they are.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import queue
import threading
import weakref
from collections.abc import Callable, Hashable
from time import perf_counter
from typing import Any, TypeVar

from flowllm import openmp

T = TypeVar("T")

_Job = tuple[
    asyncio.AbstractEventLoop,
    "asyncio.Future[Any]",
    Callable[..., Any],
    tuple[Any, ...],
    Callable[[float], None],
]

INLINE_BUDGET_S = 0.0005  # a call this short runs on the caller's thread (see above)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def name_os_thread(name: str) -> None:
    """Give the calling thread `name` in the OS (what /proc/PID/task/*/comm and `ps` show,
    15 bytes), where Linux has it; the threads it starts take the name with them."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, name.encode()[:15])  # PR_SET_NAME


def _serve(jobs: queue.SimpleQueue[_Job | None], name: str, pool_threads: int) -> None:
    """The thread: run jobs in order until the stop sentinel (None). It holds nothing of a
    finished job while it waits for the next, so that the job's owner can be collected."""
    name_os_thread(name)
    openmp.size_pool(pool_threads)
    while True:
        job = jobs.get()
        if job is None:
            return
        _run(*job)
        del job


def _run(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[Any],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    done: Callable[[float], None],
) -> None:
    result, error = None, None
    started = perf_counter()
    try:
        result = fn(*args)
    except BaseException as e:  # handed to the caller, as anyio does
        error = e
    done(perf_counter() - started)
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
    """One thread running calls in order, started at the first call, its parallel regions
    on `pool_threads`; it stops at `close` or when this object is collected. Short calls
    run on the caller's thread (see above)."""

    def __init__(
        self, name: str, pool_threads: int = 1, inline_budget: float = INLINE_BUDGET_S
    ) -> None:
        self.name = name
        self.pool_threads = pool_threads
        self.inline_budget = inline_budget
        self._jobs: queue.SimpleQueue[_Job | None] | None = None
        self._thread: threading.Thread | None = None
        self._seconds: dict[Hashable, float] = {}  # size class -> its last call's seconds
        # Calls handed to the thread, counted by the caller; and finished, counted by the
        # thread: equal when the thread has nothing queued or running.
        self._submitted = 0
        self._finished = 0
        self.inline_calls = 0  # calls run on the caller's thread, since the start

    def _start(self) -> queue.SimpleQueue[_Job | None]:
        jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=_serve, args=(jobs, self.name, self.pool_threads), name=self.name, daemon=True
        )
        self._thread.start()
        weakref.finalize(self, jobs.put, None)
        _running[self._thread] = jobs
        self._jobs = jobs
        return jobs

    async def run(self, fn: Callable[..., T], *args: Any, size: Hashable = None) -> T:
        """`fn(*args)`, in this thread or (a short call of size class `size`) right here;
        its result or exception."""
        if (
            size is not None
            and self._submitted == self._finished
            and self._seconds.get(size, self.inline_budget + 1) <= self.inline_budget
        ):
            self.inline_calls += 1
            started = perf_counter()
            try:
                return fn(*args)
            finally:
                self._seconds[size] = perf_counter() - started
        jobs = self._jobs or self._start()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def done(seconds: float) -> None:  # in the thread, before the result is handed back
            if size is not None:
                self._seconds[size] = seconds
            self._finished += 1

        self._submitted += 1
        jobs.put((loop, future, fn, args, done))
        return await future

    def close(self) -> None:
        """Stop the thread once the calls already queued have run."""
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = None
