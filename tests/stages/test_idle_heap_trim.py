"""The schedule stage's heap trim fires once per idle period, after the idleness lasted,
and never while messages keep coming. Driven directly: a stream stands for the stage's
inputs, a counter for glibc's trim."""

from __future__ import annotations

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
        self.done = anyio.Event()

    def __call__(self) -> None:
        self.count += 1
        self.done.set()


@pytest.mark.anyio
async def test_trims_once_after_idleness() -> None:
    trims = Trims()
    trigger = IdleHeapTrim(idle_seconds=0.01, trim=trims)
    send, receive = anyio.create_memory_object_stream[str](8)
    received: list[str] = []

    async def wait_idle() -> None:
        received.append(await trigger.receive(receive.receive))

    with anyio.fail_after(HANG_GUARD_S):
        trigger.worked()
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_idle)
            await trims.done.wait()  # idle with work behind it: trimmed...
            await send.send("request")  # ...and the wait goes on to the next message
        assert (trims.count, received) == (1, ["request"])

        # Idle again without work since: nothing more to give back, no trim.
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_idle)
            await anyio.sleep(0.2)  # twenty idle periods
            await send.send("later")
        assert (trims.count, received) == (1, ["request", "later"])

        # Work again: the next idle period trims once more.
        trigger.worked()
        trims.done = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_idle)
            await trims.done.wait()
            await send.send("last")
        assert trims.count == 2


@pytest.mark.anyio
async def test_no_trim_while_messages_keep_coming() -> None:
    trims = Trims()
    trigger = IdleHeapTrim(idle_seconds=1.0, trim=trims)
    send, receive = anyio.create_memory_object_stream[int](1)

    async def trickle() -> None:
        for i in range(200):
            await send.send(i)
            await anyio.sleep(0.001)

    with anyio.fail_after(HANG_GUARD_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(trickle)
            for i in range(200):
                trigger.worked()  # each message is a step's work
                assert await trigger.receive(receive.receive) == i
    assert trims.count == 0


def test_a_negative_idle_time_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 0"):
        IdleHeapTrim(idle_seconds=-1.0)
