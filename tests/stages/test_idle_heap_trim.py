"""Execute's heap trim fires once per idle period, after the idleness lasted, and never
while steps keep coming or one is running. Driven directly: `stepping`/`stepped` stand for
the stage's steps, a counter for glibc's trim (which runs in a thread)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import anyio
import pytest

from flowllm.stages.idle_heap_trim import IdleHeapTrim

HANG_GUARD_S = 30.0  # a broken trigger fails instead of hanging; not a duration check


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Trims:
    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            self.count += 1


async def until(condition: Callable[[], bool]) -> None:
    while not condition():
        await anyio.sleep(0.002)


async def step(trigger: IdleHeapTrim, seconds: float = 0.0) -> None:
    trigger.stepping()
    await anyio.sleep(seconds)
    trigger.stepped()


@pytest.mark.anyio
async def test_trims_once_after_idleness_and_again_after_more_work() -> None:
    trims = Trims()
    trigger = IdleHeapTrim(idle_seconds=0.01, trim=trims)
    with anyio.fail_after(HANG_GUARD_S):
        await step(trigger)
        await until(lambda: trims.count == 1)  # idle with work behind it: trimmed
        await anyio.sleep(0.2)  # twenty idle periods without work: nothing more to give back
        assert trims.count == 1
        await step(trigger)  # work again: the next idle period trims once more
        await until(lambda: trims.count == 2)
        await anyio.sleep(0.1)
        assert trims.count == 2


@pytest.mark.anyio
async def test_no_trim_while_steps_keep_coming_or_one_runs() -> None:
    trims = Trims()
    trigger = IdleHeapTrim(idle_seconds=0.05, trim=trims)
    with anyio.fail_after(HANG_GUARD_S):
        for _ in range(100):  # gaps far under the idle time
            await step(trigger)
            await anyio.sleep(0.001)
        await step(trigger, seconds=0.2)  # one step four idle periods long
        assert trims.count == 0
        await until(lambda: trims.count == 1)  # then idle: trimmed


@pytest.mark.anyio
async def test_close_cancels_a_pending_trim() -> None:
    trims = Trims()
    trigger = IdleHeapTrim(idle_seconds=0.01, trim=trims)
    await step(trigger)
    trigger.close()
    await anyio.sleep(0.1)
    assert trims.count == 0


def test_a_negative_idle_time_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 0"):
        IdleHeapTrim(idle_seconds=-1.0)
