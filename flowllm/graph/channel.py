"""Typed bounded channels: the only way messages move between stages.

A channel is an anyio memory object stream pair with a name, a declared message type and a
finite capacity, so a slow consumer makes its producers wait instead of letting a queue
grow without bound. Every send stamps `time.perf_counter()`; the receiver turns the stamp
into the message's queue wait. Taps see every message sent (trace recorder, metrics).

Ownership follows anyio's rule: every producer task gets its own `sender()` clone and every
consumer task its own `receiver()` clone, then the channel's originals are closed with
`close()`. When the last sender clone closes, consumers drain what is buffered and then see
`anyio.EndOfStream`, which is how the end of a stream propagates down the graph.

Waiting on several channels at once (a stage with several inputs) uses wake-up futures the
send side resolves after each successful send and on close: see `ChannelReceiver.add_waiter`.
They are asyncio futures, not anyio events (a graph runs on anyio's asyncio backend): an
anyio event costs a wrapper object and an inner asyncio event per wait, several µs on each
hop of a step.
"""

from __future__ import annotations

import asyncio
import types
import typing
from collections.abc import Callable
from time import perf_counter
from typing import Any, Generic, TypeVar

import anyio
from anyio.streams.memory import (
    MemoryObjectReceiveStream,
    MemoryObjectSendStream,
    MemoryObjectStreamStatistics,
)

T = TypeVar("T")

Tap = Callable[[object, float], None]
"""Called as `tap(message, send_time)` after every successful send; must not block."""

Waiter = asyncio.Future[None]
"""Resolved after the next send on, or close of, a channel it waits on."""


def _wake(waiters: set[Waiter]) -> None:
    for waiter in tuple(waiters):
        if not waiter.done():
            waiter.set_result(None)


class ChannelTypeError(TypeError):
    """A message was sent on a channel whose declared type does not admit it."""


class BrokenChannelError(anyio.BrokenResourceError):
    """A send found that every consumer of the channel has finished."""


def type_members(tp: object) -> tuple[type, ...] | None:
    """The classes a port type admits, or None when it admits anything.

    Unions (`A | B`, `Optional[A]`) expand to their members; a parametrised generic such as
    `list[int]` checks only its origin class. Raises TypeError for something that is not a
    type, so the graph validator can report a badly declared port.
    """
    if tp is Any or tp is object:
        return None
    if tp is None or tp is type(None):
        return (type(None),)
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        members: list[type] = []
        for arg in typing.get_args(tp):
            sub = type_members(arg)
            if sub is None:
                return None
            members.extend(sub)
        return tuple(dict.fromkeys(members))
    if origin is typing.Literal:
        return tuple(dict.fromkeys(type(value) for value in typing.get_args(tp)))
    if origin is typing.Annotated:
        return type_members(typing.get_args(tp)[0])
    if isinstance(origin, type):
        return (origin,)
    if isinstance(tp, type):
        return (tp,)
    raise TypeError(f"{tp!r} is not a type")


def type_name(tp: object) -> str:
    """A short human name for a port type, e.g. `TokenizedRequest | Abort`."""
    try:
        members = type_members(tp)
    except TypeError:
        return repr(tp)
    if members is None:
        return "Any"
    return " | ".join("None" if m is type(None) else m.__name__ for m in members)


def check_type(
    name: str, message_type: object, accepts: tuple[type, ...] | None, message: object
) -> None:
    """Raise ChannelTypeError unless channel `name` (declared `message_type`, admitting
    the classes `accepts`) may carry `message`: what every send end checks."""
    if accepts is not None and not isinstance(message, accepts):
        raise ChannelTypeError(
            f"channel {name!r} carries {type_name(message_type)}, got {type(message).__name__}"
        )


class Channel(Generic[T]):
    """A named, typed, bounded channel; clone an end per task, then `close()` the originals."""

    def __init__(self, name: str, message_type: object, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"channel {name!r}: capacity must be an int >= 1, got {capacity!r}")
        self.name = name
        self.message_type = message_type
        self.capacity = capacity
        # The stream carries (message, send_time) pairs; capacity counts messages.
        send, receive = anyio.create_memory_object_stream[tuple[T, float]](capacity)
        self._send: MemoryObjectSendStream[tuple[T, float]] = send
        self._receive: MemoryObjectReceiveStream[tuple[T, float]] = receive
        # Shared by reference with every clone, so a tap added later is seen by all senders.
        self._taps: list[Tap] = []
        self._waiters: set[Waiter] = set()
        self._accepts = type_members(message_type)
        # Messages sent and not yet received, and send ends open (the original counts until
        # `close`): a receiver with nothing to read sees it here, where asking the stream
        # costs a raised WouldBlock per empty port, several on every wait of a step.
        self.unread = 0
        self.open_senders = 1
        self._originals_open = True

    def __repr__(self) -> str:
        return (
            f"Channel({self.name!r}, {type_name(self.message_type)}, "
            f"depth={self.depth()}/{self.capacity})"
        )

    def add_tap(self, tap: Tap) -> None:
        """Call `tap(message, send_time)` after every send on this channel."""
        self._taps.append(tap)

    def depth(self) -> int:
        """Messages buffered now (never more than `capacity`)."""
        return self._send.statistics().current_buffer_used

    def statistics(self) -> MemoryObjectStreamStatistics:
        return self._send.statistics()

    def sender(self) -> ChannelSender[T]:
        """A send end for one producer task; close it when that task ends."""
        return ChannelSender(self, self._send.clone())

    def receiver(self) -> ChannelReceiver[T]:
        """A receive end for one consumer task; close it when that task ends."""
        return ChannelReceiver(self, self._receive.clone())

    def close(self) -> None:
        """Close the originals once every task has its clone."""
        if self._originals_open:
            self._originals_open = False
            self.open_senders -= 1
        self._send.close()
        self._receive.close()
        self._wake_waiters()

    @property
    def nothing_to_read(self) -> bool:
        """No message is buffered, and a sender may still send one (else a receive ends)."""
        return not self.unread and self.open_senders > 0

    def _wake_waiters(self) -> None:
        _wake(self._waiters)


class ChannelSender(Generic[T]):
    """One producer task's end of a channel."""

    __slots__ = ("_accepts", "_closed", "_stream", "_taps", "_waiters", "channel")

    def __init__(
        self, channel: Channel[T], stream: MemoryObjectSendStream[tuple[T, float]]
    ) -> None:
        self.channel = channel
        self._stream = stream
        self._taps = channel._taps
        self._waiters = channel._waiters
        self._accepts = channel._accepts
        self._closed = False
        channel.open_senders += 1

    def _check(self, message: object) -> None:
        check_type(self.channel.name, self.channel.message_type, self._accepts, message)

    async def send(self, message: T) -> None:
        """Send, waiting only while the channel is full (backpressure). A send that finds
        room returns without yielding to the loop: the receiver's own wait is the step's
        yield, and a hop through the loop per send was a large share of a small step."""
        self._check(message)
        now = perf_counter()
        channel = self.channel
        # Counted before any wait: a receive may take the message in before this task runs
        # again, and a wait cancelled after that has delivered it (a count too high costs
        # the receiver one check of the stream, a count too low would strand the message).
        channel.unread += 1
        try:
            try:
                self._stream.send_nowait((message, now))
            except anyio.WouldBlock:
                await self._stream.send((message, now))
        except anyio.get_cancelled_exc_class():
            raise
        except anyio.BrokenResourceError:
            channel.unread -= 1
            raise self._broken() from None
        except BaseException:
            channel.unread -= 1
            raise
        self._sent(message, now)

    def send_nowait(self, message: T) -> None:
        """Send if there is room now; raises `anyio.WouldBlock` when the channel is full."""
        self._check(message)
        now = perf_counter()
        try:
            self._stream.send_nowait((message, now))
        except anyio.BrokenResourceError:
            raise self._broken() from None
        self.channel.unread += 1
        self._sent(message, now)

    def _broken(self) -> BrokenChannelError:
        return BrokenChannelError(f"channel {self.channel.name!r}: every consumer has finished")

    def _sent(self, message: T, now: float) -> None:
        """After a send: taps see the message, waiters for it wake."""
        for tap in self._taps:
            tap(message, now)
        if self._waiters:
            _wake(self._waiters)

    def has_room(self) -> bool:
        """Would `send_nowait` succeed now? (Single event loop: true until the next await.)"""
        stats = self._stream.statistics()
        return stats.current_buffer_used < stats.max_buffer_size or stats.tasks_waiting_receive > 0

    def room(self) -> int:
        """How many `send_nowait` calls would succeed now, in a row."""
        stats = self._stream.statistics()
        free = int(stats.max_buffer_size) - stats.current_buffer_used
        return free + stats.tasks_waiting_receive

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close this clone; the last one to close ends the stream for the consumers."""
        if not self._closed:
            self._closed = True
            self.channel.open_senders -= 1
            self._stream.close()
            self.channel._wake_waiters()


class ChannelReceiver(Generic[T]):
    """One consumer task's end of a channel; `last_wait` is the latest message's queue wait."""

    __slots__ = ("_closed", "_stream", "channel", "last_wait")

    def __init__(
        self, channel: Channel[T], stream: MemoryObjectReceiveStream[tuple[T, float]]
    ) -> None:
        self.channel = channel
        self._stream = stream
        self.last_wait = 0.0  # seconds between send and receive of the last message
        self._closed = False

    async def receive(self) -> T:
        """The next message; raises `anyio.EndOfStream` once closed and drained."""
        message, sent = await self._stream.receive()
        self.channel.unread -= 1
        self.last_wait = perf_counter() - sent
        return message

    def receive_nowait(self) -> T:
        """The next message if one is buffered; raises `anyio.WouldBlock` or `EndOfStream`."""
        message, sent = self._stream.receive_nowait()
        self.channel.unread -= 1
        self.last_wait = perf_counter() - sent
        return message

    def __aiter__(self) -> ChannelReceiver[T]:
        return self

    async def __anext__(self) -> T:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    @property
    def exhausted(self) -> bool:
        """Closed by every producer and drained: no message will ever arrive."""
        stats = self._stream.statistics()
        return (
            stats.open_send_streams == 0
            and stats.current_buffer_used == 0
            and stats.tasks_waiting_send == 0
        )

    def add_waiter(self, waiter: Waiter) -> None:
        """Resolve `waiter` after the next send on (or close of) this channel."""
        self.channel._waiters.add(waiter)

    def remove_waiter(self, waiter: Waiter) -> None:
        self.channel._waiters.discard(waiter)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._stream.close()
