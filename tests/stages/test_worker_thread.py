"""A stage's worker thread: results and errors come back, calls run in order on one thread
that outlives an event loop, a cancelled caller stops waiting while its call completes, and
the thread stops when closed or collected. A sized call runs on the caller's thread once
its size class is known to be short, never while the thread still has a call, and goes
back to the thread once it is not short."""

from __future__ import annotations

import gc
import threading
import time

import anyio
import pytest

from flowllm.stages.worker import WorkerThread


def test_calls_run_in_order_on_one_lasting_thread() -> None:
    worker = WorkerThread("flowllm-test")
    seen: list[tuple[str, int]] = []

    def call(i: int) -> int:
        seen.append((threading.current_thread().name, i))
        return i * i

    async def main(start: int) -> list[int]:
        return [await worker.run(call, i) for i in range(start, start + 3)]

    assert anyio.run(main, 0) == [0, 1, 4]
    assert anyio.run(main, 3) == [9, 16, 25]  # another event loop, the same thread
    assert seen == [("flowllm-test", i) for i in range(6)]
    worker.close()


def test_errors_reach_the_caller() -> None:
    worker = WorkerThread("flowllm-test")

    def fail() -> None:
        raise ValueError("bad step")

    async def main() -> None:
        with pytest.raises(ValueError, match="bad step"):
            await worker.run(fail)
        assert await worker.run(lambda: 7) == 7  # the thread goes on

    anyio.run(main)
    worker.close()


def test_a_cancelled_caller_stops_waiting_and_the_call_completes_first() -> None:
    worker = WorkerThread("flowllm-test")
    order: list[str] = []
    release = threading.Event()

    def slow() -> str:
        release.wait(5)
        order.append("slow done")
        return "slow"

    def next_call() -> str:
        order.append("next")
        return "next"

    async def main() -> None:
        started = time.monotonic()
        with anyio.move_on_after(0.05) as scope:
            await worker.run(slow)
        assert scope.cancelled_caught
        assert time.monotonic() - started < 2  # did not wait for the call
        release.set()
        assert await worker.run(next_call) == "next"

    anyio.run(main)
    assert order == ["slow done", "next"]
    worker.close()


def test_the_thread_stops_when_closed_or_collected() -> None:
    def thread_of(worker: WorkerThread) -> threading.Thread:
        async def main() -> threading.Thread:
            return await worker.run(threading.current_thread)

        return anyio.run(main)

    closed = WorkerThread("flowllm-test")
    thread = thread_of(closed)
    closed.close()
    thread.join(5)
    assert not thread.is_alive()

    dropped = WorkerThread("flowllm-test")
    thread = thread_of(dropped)
    del dropped
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()


def test_a_short_size_class_runs_on_the_callers_thread() -> None:
    worker = WorkerThread("flowllm-test", inline_budget=0.05)
    where: list[tuple[str, str]] = []

    def call(label: str, seconds: float = 0.0) -> None:
        time.sleep(seconds)
        where.append((label, threading.current_thread().name))

    async def main() -> None:
        caller = threading.current_thread().name
        for _ in range(2):
            await worker.run(call, "short", size="short")
            await worker.run(call, "unsized")
            await worker.run(call, "slow", 0.1, size="slow")
        await worker.run(call, "short, now slow", 0.1, size="short")  # known short: inline
        await worker.run(call, "short again", size="short")  # its last call was slow
        await worker.run(call, "short again", size="short")
        assert where == [
            ("short", "flowllm-test"),  # not seen yet
            ("unsized", "flowllm-test"),
            ("slow", "flowllm-test"),
            ("short", caller),
            ("unsized", "flowllm-test"),  # never inline
            ("slow", "flowllm-test"),  # over the budget
            ("short, now slow", caller),
            ("short again", "flowllm-test"),
            ("short again", caller),
        ]
        assert worker.inline_calls == 3

    anyio.run(main)
    worker.close()


def test_a_short_call_waits_behind_a_call_still_in_the_thread() -> None:
    worker = WorkerThread("flowllm-test")
    order: list[tuple[str, str]] = []
    release = threading.Event()

    def call(label: str) -> None:
        if label == "slow":
            release.wait(5)
        order.append((label, threading.current_thread().name))

    async def main() -> None:
        await worker.run(call, "first", size="short")
        await worker.run(call, "second", size="short")  # known short: inline
        with anyio.move_on_after(0.05):
            await worker.run(call, "slow")  # the caller gives up; the call goes on
        release.set()
        await worker.run(call, "third", size="short")  # behind "slow", in the thread

    anyio.run(main)
    assert order == [
        ("first", "flowllm-test"),
        ("second", "MainThread"),
        ("slow", "flowllm-test"),
        ("third", "flowllm-test"),
    ]
    worker.close()
