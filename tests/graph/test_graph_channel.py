"""Channels and the stage context: types, taps, depth, queue wait, receive_any."""

from __future__ import annotations

import logging
import re
from typing import Any

import anyio
import pytest
import structlog
from graph_toys import Item, Other

from flowllm.graph.channel import BrokenChannelError, Channel, ChannelTypeError, type_name
from flowllm.graph.metrics import GraphMetrics
from flowllm.graph.spans import SpanRecorder
from flowllm.graph.stage import CLOSED, Outbox, StageContext


def test_capacity_must_be_finite_and_positive() -> None:
    for bad in (0, -1, 1.5, True, float("inf")):
        with pytest.raises(ValueError, match="capacity"):
            Channel("x.in", Item, bad)  # type: ignore[arg-type]


def test_type_check_taps_depth_and_queue_wait() -> None:
    channel: Channel[Item] = Channel("sink.in", Item | Other, 3)
    assert type_name(channel.message_type) == "Item | Other"
    seen: list[tuple[Any, float]] = []
    channel.add_tap(lambda message, sent: seen.append((message, sent)))
    sender, receiver = channel.sender(), channel.receiver()
    channel.close()

    async def main() -> None:
        expected = re.escape("'sink.in' carries Item | Other, got int")
        with pytest.raises(ChannelTypeError, match=expected):
            await sender.send(3)  # type: ignore[arg-type]
        await sender.send(Item(1))
        sender.send_nowait(Other("x"))  # type: ignore[arg-type]
        await sender.send(Item(2))
        assert channel.depth() == 3
        assert not sender.has_room()
        with pytest.raises(anyio.WouldBlock):
            sender.send_nowait(Item(3))
        await anyio.sleep(0.01)
        assert await receiver.receive() == Item(1)
        assert receiver.last_wait >= 0.009  # it waited in the channel for the sleep
        assert channel.depth() == 2
        sender.close()
        rest = [message async for message in receiver]
        assert rest == [Other("x"), Item(2)]
        assert receiver.exhausted

    anyio.run(main)
    # Taps saw each successful send once, in order, with increasing send times.
    assert [m for m, _ in seen] == [Item(1), Other("x"), Item(2)]
    assert seen[0][1] <= seen[1][1] <= seen[2][1]


def test_a_send_yields_to_the_loop_only_when_the_channel_is_full() -> None:
    """With room, `send` returns before any other task runs (no hop through the loop); on
    a full channel it waits, and the consumer runs, until there is room."""
    channel: Channel[Item] = Channel("sink.in", Item, 2)
    sender, receiver = channel.sender(), channel.receiver()
    channel.close()
    ran: list[str] = []

    async def consume() -> None:
        ran.append("consumer")
        ran.append(f"got {(await receiver.receive()).seq}")

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await sender.send(Item(1))
            await sender.send(Item(2))
            assert ran == []  # room both times: the consumer has not run yet
            await sender.send(Item(3))  # full: waits while the consumer takes one
            assert ran == ["consumer", "got 1"]

    anyio.run(main)


def test_sending_after_every_consumer_left_names_the_channel() -> None:
    channel: Channel[Item] = Channel("sink.in", Item, 1)
    sender, receiver = channel.sender(), channel.receiver()
    channel.close()
    receiver.close()

    async def main() -> None:
        with pytest.raises(BrokenChannelError, match=re.escape("'sink.in'")):
            await sender.send(Item(0))

    anyio.run(main)


def make_context(
    ports: dict[str, Channel[Any]], outputs: dict[str, list[Channel[Any]]] | None = None
) -> StageContext:
    log = structlog.wrap_logger(
        None,
        processors=[],
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
    )
    return StageContext(
        name="merge",
        replica=0,
        inboxes={port: channel.receiver() for port, channel in ports.items()},
        outboxes={
            port: Outbox(port, [c.sender() for c in chans])
            for port, chans in (outputs or {}).items()
        },
        log=log,
        spans=SpanRecorder("merge", log, GraphMetrics()),
        stop_requested=anyio.Event(),
    )


def test_receive_any_gives_the_first_port_priority_and_reports_closure_once() -> None:
    urgent: Channel[Item] = Channel("merge.urgent", Item, 8)
    normal: Channel[Item] = Channel("merge.normal", Item, 8)
    to_urgent, to_normal = urgent.sender(), normal.sender()

    async def main() -> None:
        ctx = make_context({"urgent": urgent, "normal": normal})
        urgent.close()
        normal.close()
        for seq in range(3):
            await to_normal.send(Item(seq, "normal"))
            await to_urgent.send(Item(seq, "urgent"))
        got = [await ctx.receive_any("urgent", "normal") for _ in range(4)]
        assert [(p, m.seq) for p, m in got] == [
            ("urgent", 0),
            ("urgent", 1),
            ("urgent", 2),
            ("normal", 0),
        ]
        to_urgent.close()
        assert await ctx.receive_any("urgent", "normal") == ("urgent", CLOSED)
        assert ctx.input_closed("urgent") and not ctx.input_closed("normal")
        assert await ctx.receive_any("urgent", "normal") == ("normal", Item(1, "normal"))
        # The other order: `normal` first.
        assert await ctx.receive_any("normal", "urgent") == ("normal", Item(2, "normal"))
        to_normal.close()
        assert await ctx.receive_any() == ("normal", CLOSED)
        with pytest.raises(anyio.EndOfStream):
            await ctx.receive_any()

    anyio.run(main)


def test_receive_any_sleeps_until_a_send_or_close_on_any_port() -> None:
    a: Channel[Item] = Channel("s.a", Item, 2)
    b: Channel[Item] = Channel("s.b", Item, 2)
    to_a, to_b = a.sender(), b.sender()
    events: list[Any] = []

    async def consumer(ctx: StageContext) -> None:
        while True:
            try:
                port, message = await ctx.receive_any()
            except anyio.EndOfStream:
                events.append("end")
                return
            events.append((port, message if message is CLOSED else message.seq))

    async def main() -> None:
        ctx = make_context({"a": a, "b": b})
        a.close()
        b.close()
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consumer, ctx)
                await anyio.sleep(0.02)
                assert events == []  # asleep, not spinning: nothing arrived yet
                assert len(a._waiters) == 1  # it registered one wake-up future
                await to_b.send(Item(7))
                await anyio.sleep(0.01)
                assert events == [("b", 7)]
                to_a.close()
                await anyio.sleep(0.01)
                assert events[-1] == ("a", CLOSED)
                await to_b.send(Item(8))
                to_b.close()
        assert events == [("b", 7), ("a", CLOSED), ("b", 8), ("b", CLOSED), "end"]
        assert not a._waiters and not b._waiters  # no wake-up futures left behind

    anyio.run(main)


def test_a_channel_counts_its_unread_messages_and_open_senders() -> None:
    """What lets `receive_any` skip an empty port without asking the stream. A full
    channel's waiting sender has counted its message already, so the receive that takes it
    in finds it: nothing is missed, and the end is seen once every sender closed."""
    channel: Channel[Item] = Channel("sink.in", Item, 1)
    first, second = channel.sender(), channel.sender()
    assert channel.open_senders == 3  # the original counts until `close`
    got: list[Any] = []

    async def produce() -> None:
        for seq in range(3):
            await first.send(Item(seq))  # the second and third wait for room
        first.close()
        second.close()
        assert channel.open_senders == 0

    async def main() -> None:
        ctx = make_context({"in": channel})
        channel.close()
        channel.close()
        assert channel.open_senders == 2 and channel.nothing_to_read
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(produce)
                while True:
                    try:
                        _, message = await ctx.receive_any()
                    except anyio.EndOfStream:
                        break
                    got.append(message if message is CLOSED else message.seq)
                    assert channel.unread in (0, 1)
        assert got == [0, 1, 2, CLOSED]
        assert channel.unread == 0 and not channel.nothing_to_read  # a receive ends

    anyio.run(main)


def test_a_send_cancelled_after_its_message_was_taken_in_still_counts_it() -> None:
    """A full channel's waiting sender cancelled once a receive moved its message into the
    buffer: the message is delivered, and `receive_any` reads it."""
    channel: Channel[Item] = Channel("sink.in", Item, 1)
    sender = channel.sender()

    async def main() -> None:
        ctx = make_context({"in": channel})
        channel.close()
        await sender.send(Item(0))
        scope = anyio.CancelScope()

        async def blocked() -> None:
            with scope:
                await sender.send(Item(1))

        async with anyio.create_task_group() as tg:
            tg.start_soon(blocked)
            await anyio.sleep(0.01)  # it waits for room
            scope.cancel()  # the sender's wait ends cancelled, when it runs again
            assert ctx.inbox("in").receive_nowait() == Item(0)  # takes Item(1) in
        assert scope.cancelled_caught
        with anyio.fail_after(1):
            assert await ctx.receive_any() == ("in", Item(1))

    anyio.run(main)


def test_fan_out_outbox_sends_to_every_channel_or_to_none() -> None:
    left: Channel[Item] = Channel("l.in", Item, 1)
    right: Channel[Item] = Channel("r.in", Item, 2)

    async def main() -> None:
        ctx = make_context({}, {"out": [left, right]})
        ctx.emit_nowait("out", Item(0))
        assert (left.depth(), right.depth()) == (1, 1)
        with pytest.raises(anyio.WouldBlock):
            ctx.emit_nowait("out", Item(1))  # left is full: nothing is sent anywhere
        assert (left.depth(), right.depth()) == (1, 1)
        with pytest.raises(KeyError, match="no output port 'outt'"):
            await ctx.emit("outt", Item(2))

    anyio.run(main)


def test_receive_any_yields_even_when_its_input_is_always_ready() -> None:
    """A stage whose input always has a message still lets the other tasks run at every
    receive (a checkpoint after it takes the message; one that must wait yields through
    its wait alone)."""
    channel: Channel[Item] = Channel("s.in", Item, 8)
    sender = channel.sender()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.lowlevel.checkpoint()

    async def main() -> None:
        ctx = make_context({"in": channel})
        channel.close()
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            await anyio.lowlevel.checkpoint()  # the ticker is running
            for seq in range(4):
                await sender.send(Item(seq))
            before = ticks
            for seq in range(4):
                assert await ctx.receive_any() == ("in", Item(seq))
            assert ticks - before >= 4  # ready every time, and it yielded every time
            tg.cancel_scope.cancel()

    anyio.run(main)


def test_a_receive_cancelled_at_its_yield_leaves_its_message_to_the_next() -> None:
    """receive_any takes a waiting message, then yields: cancelled there (a stage restarted
    or stopped), the message is not lost, and the next call returns it first."""
    urgent: Channel[Item] = Channel("s.urgent", Item, 4)
    normal: Channel[Item] = Channel("s.normal", Item, 4)
    to_urgent, to_normal = urgent.sender(), normal.sender()

    async def main() -> None:
        ctx = make_context({"urgent": urgent, "normal": normal})
        await to_normal.send(Item(1, "normal"))
        with anyio.CancelScope() as scope:
            scope.cancel()
            await ctx.receive_any()
        assert scope.cancelled_caught
        assert normal.depth() == 0  # taken, and held
        await to_urgent.send(Item(2, "urgent"))
        assert await ctx.receive_any("urgent") == ("urgent", Item(2, "urgent"))  # not its port
        assert await ctx.receive_any() == ("normal", Item(1, "normal"))
        to_urgent.close()
        to_normal.close()
        urgent.close()
        normal.close()
        assert [await ctx.receive_any() for _ in range(2)] == [
            ("urgent", CLOSED),
            ("normal", CLOSED),
        ]

    anyio.run(main)
