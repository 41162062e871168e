"""Channels whose two ends run in different processes, with a local channel's contract.

A graph placed across processes (stages with `process:`) runs one `Graph` per process.
An edge between two of them is carried by a `Peer`, this process's view of one other
process: for each such channel it holds the send end (`RemoteChannel`, which a local
producer's `Outbox` uses like any channel) or the receive end (clones of the local
channel's sender, fed with what arrives). The contract holds across the boundary:

- **Typed**: the sender checks each message against the declared type, the receiver
  decodes it as exactly the class it was sent as (flowllm/graph/wire.py).
- **Bounded**: a sender holds `capacity` credits per peer and spends one per message;
  the receiver owes a credit once the message is in its local channel. So a full
  channel makes its remote producer wait, and a cross-process edge holds at most its
  capacity in transit and its capacity in the receiving process (the validator's
  capacity rules count both). Owed credits go back together: at once when half a
  channel's capacity is owed, with anything else sent, or `CREDIT_DELAY_S` after the
  first is owed. A step's tokens cross every step; their credits need not cross back
  every step, waking the step loop's process for nothing (a sender with half its
  credits never waits for the rest, and one that does waits at most the delay).
- **End of stream**: when every local producer of a channel has finished, its peers get
  `END`, and the receiving side closes its sender clone once what came before is in.
- **Observed on both sides**: the send side's taps, depth and spans are this process's;
  the receive side's local channel has its own.

A peer may go away (its process died) and come back (restarted): the `Peer` outlives its
connections. While it is away, what a local producer sends it is handed to
`undeliverable` (the owner fails the requests it belongs to) instead of blocking the
graph; on reconnection credits start afresh, and the receive side's clones stay open, so
the local stages never see an end that did not happen. A `replaceable` peer's `END` is
not the end of its channels here either: the owner ends them (`close_inbound`) when
this process stops.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import Callable, Sequence
from time import perf_counter
from typing import Any

import anyio
import anyio.abc
import msgspec
import structlog

from flowllm.graph.channel import (
    Channel,
    ChannelSender,
    Tap,
    check_type,
    type_members,
    type_name,
)
from flowllm.graph.link import FrameLink
from flowllm.graph.stage import RequestInputError
from flowllm.graph.validator import ChannelSpec
from flowllm.graph.wire import (
    CONTROL,
    CREDIT,
    DATA,
    END,
    ChannelCodec,
    Frame,
    WireError,
    encode_control,
    encode_frame,
)

Undeliverable = Callable[[str, object], None]
"""Called as `undeliverable(channel_name, message)` for a message sent to an absent peer."""

ControlHandler = Callable[["Peer", object], None]
"""Called with each control message a peer sends (hello, heartbeat: the owner's business)."""

Observer = Callable[["Peer", str, object], None]
"""Called as `observe(peer, channel_name, message)` for each message a peer sends here."""

Route = Callable[[str, object], Sequence[tuple[int, object]]]
"""Splits a message on a channel consumed by several peers: `(peer index, part)` pairs."""


CREDIT_DELAY_S = 0.002  # how long an owed credit may wait for others to go with it


class PeerGone(ConnectionError):
    """The peer's connection ended."""


class _Inbound:
    """Messages of one channel from one peer, on their way into the local channel."""

    __slots__ = ("codec", "credit_batch", "ended", "index", "overflow", "ready", "sender")

    def __init__(
        self, index: int, codec: ChannelCodec, sender: ChannelSender[Any], capacity: int
    ) -> None:
        self.index = index
        self.codec = codec
        self.sender = sender
        self.credit_batch = max(1, capacity // 2)  # owed credits that go back at once
        # Arrived while the local channel was full (its local producers share it); bounded
        # by the credits the peer holds.
        self.overflow: deque[object] = deque()
        self.ready: anyio.Event | None = None  # made by the pump, in the event loop
        self.ended = False


class Peer:
    """One other process, as the channels between it and this one see it."""

    def __init__(
        self,
        process: str,
        index: int,
        codecs: dict[str, tuple[int, ChannelCodec]],
        *,
        on_control: ControlHandler,
        undeliverable: Undeliverable,
        observe: Observer | None = None,
        replaceable: bool = False,
    ) -> None:
        self.process = process
        self.index = index  # among the peers of one replicated process (fronts)
        self._codecs = codecs  # channel name -> (wire number, codec), for both directions
        self._on_control = on_control
        self._undeliverable = undeliverable
        self._observe = observe
        # A peer whose process is restarted (a core) or comes and goes (a front) ends its
        # channels by ending: its END does not end them here, `close_inbound` does.
        self._replaceable = replaceable
        self._capacity: dict[int, int] = {}  # outbound channel number -> its capacity
        self._credits: dict[int, int] = {}
        self._credit_freed: dict[int, anyio.Event] = {}  # made by `attach`, in the loop
        self._inbound: dict[int, _Inbound] = {}
        self._pending_credits: dict[int, int] = {}
        self._credit_timer: asyncio.TimerHandle | None = None
        self._link: FrameLink | None = None
        self._pumps: anyio.abc.TaskGroup | None = None
        self._attached = False
        self.log = structlog.get_logger("flowllm.graph").bind(peer=process, index=index)

    # -- what the runtime wires ----------------------------------------------------------

    def add_outbound(self, name: str, capacity: int) -> None:
        number = self._codecs[name][0]
        self._capacity[number] = capacity
        self._credits[number] = capacity
        if self._attached:  # wired while connected (a front builds its graph then)
            self._credit_freed[number] = anyio.Event()

    def add_inbound(self, name: str, sender: ChannelSender[Any], capacity: int) -> None:
        number, codec = self._codecs[name]
        inbound = self._inbound[number] = _Inbound(number, codec, sender, capacity)
        if self._pumps is not None:
            self._pumps.start_soon(self._pump, inbound)

    @property
    def attached(self) -> bool:
        return self._attached

    # -- sending -------------------------------------------------------------------------

    def credits(self, name: str) -> int:
        """Messages this peer takes on `name` now without waiting (any, while it is away:
        they are handed to `undeliverable`)."""
        number = self._codecs[name][0]
        return self._credits[number] if self._attached else self._capacity[number]

    async def send(self, name: str, message: object) -> None:
        number, codec = self._codecs[name]
        while self._attached and self._credits[number] <= 0:
            await self._credit_freed[number].wait()
        self.send_nowait(name, message, number, codec)

    def send_nowait(
        self, name: str, message: object, number: int = -1, codec: ChannelCodec | None = None
    ) -> None:
        if codec is None:
            number, codec = self._codecs[name]
        if not self._attached:
            self._undeliverable(name, message)
            return
        if self._credits[number] <= 0:
            raise anyio.WouldBlock
        try:
            frame = encode_frame(DATA, number, codec.member(message), message)
        except (OverflowError, msgspec.EncodeError) as exc:
            # Only a request's own values are unbounded (an integer past 64 bits).
            raise RequestInputError(f"A value in this request cannot be carried: {exc}") from None
        self._credits[number] -= 1
        self._queue(frame)

    def end(self, name: str) -> None:
        """Every local producer of `name` has finished."""
        if self._attached:
            self._queue(encode_frame(END, self._codecs[name][0]))

    def send_control(self, message: object) -> None:
        if self._attached:
            self._queue(encode_control(message))

    def in_transit(self, name: str) -> int:
        number = self._codecs[name][0]
        return self._capacity[number] - self._credits[number] if self._attached else 0

    def _queue(self, frame: bytes) -> None:
        assert self._link is not None  # only while attached
        self._link.write(frame)

    # -- the connection ------------------------------------------------------------------

    async def attach(self, sock: socket.socket, greeting: object = None) -> None:
        """Carry this peer's channels over the connected `sock` until it ends (closing it
        then); raises PeerGone then.

        `greeting`, when given, is the first control message sent. Called again with a
        new socket after a reconnection; credits start afresh.
        """
        if self._attached:
            raise RuntimeError(f"peer {self.process}[{self.index}] is already attached")
        for number, capacity in self._capacity.items():
            self._credits[number] = capacity
            self._credit_freed[number] = anyio.Event()
        self._pending_credits.clear()
        link = self._link = FrameLink(sock, self._on_frame, self._credit_frames)
        if greeting is not None:
            self._queue(encode_control(greeting))
        self._attached = True
        try:
            await link.run()
        except WireError as exc:
            self.log.error("peer sent an unreadable stream; disconnecting", error=str(exc))
        finally:
            self._attached = False
            self._link = None
            self._cancel_credit_timer()
            for event in self._credit_freed.values():
                event.set()  # senders waiting for credit: the peer is gone, stop waiting
            sock.close()
        raise PeerGone(f"peer {self.process}[{self.index}] disconnected")

    def detach(self) -> None:
        """Close the connection (the peer sees it end)."""
        if self._link is not None:
            self._link.close()

    def _credit_frames(self) -> list[bytes]:
        """The credits owed to the peer, one frame per channel (they leave with this send)."""
        self._cancel_credit_timer()
        if not self._pending_credits:
            return []
        credits, self._pending_credits = self._pending_credits, {}
        return [encode_frame(CREDIT, number, count) for number, count in credits.items()]

    def _on_frame(self, frame: Frame) -> None:
        kind = frame.kind
        if kind == DATA:
            inbound = self._inbound[frame.channel]
            message = inbound.codec.decode(frame.member, frame.payload)
            if self._observe is not None:
                self._observe(self, inbound.codec.name, message)
            self._deliver(inbound, message)
        elif kind == CREDIT:
            self._credits[frame.channel] += frame.member
            self._credit_freed[frame.channel].set()
            self._credit_freed[frame.channel] = anyio.Event()
        elif kind == END:
            if self._replaceable:
                return
            inbound = self._inbound[frame.channel]
            inbound.ended = True
            if not inbound.overflow:
                inbound.sender.close()
        elif kind == CONTROL:
            self._on_control(self, frame.payload)
        else:
            raise WireError(f"unknown frame kind {kind}")

    def _deliver(self, inbound: _Inbound, message: object) -> None:
        if inbound.sender.closed:
            return  # late: this process has stopped taking the channel (`close_inbound`)
        if not inbound.overflow:
            try:
                inbound.sender.send_nowait(message)
            except anyio.WouldBlock:
                pass
            except anyio.BrokenResourceError:
                return  # late: the channel's consumer has finished
            else:
                self._credit(inbound.index)
                return
        inbound.overflow.append(message)
        if inbound.ready is not None:
            inbound.ready.set()

    def inject(self, name: str, message: object) -> None:
        """Hand `message` to the local consumer of `name` as if this peer had sent it (the
        owner speaks for a peer that died: the ends of the sequences it was running)."""
        inbound = self._inbound[self._codecs[name][0]]
        if not inbound.ended:
            self._deliver(inbound, message)

    def _credit(self, number: int) -> None:
        owed = self._pending_credits[number] = self._pending_credits.get(number, 0) + 1
        link = self._link
        if link is None:
            return
        if owed >= self._inbound[number].credit_batch:
            link.send_soon()
        elif self._credit_timer is None:
            loop = asyncio.get_running_loop()
            self._credit_timer = loop.call_later(CREDIT_DELAY_S, link.send_soon)

    def _cancel_credit_timer(self) -> None:
        if self._credit_timer is not None:
            self._credit_timer.cancel()
            self._credit_timer = None

    async def pump_overflow(self) -> None:
        """Move what arrived while local channels were full into them, in order (run for
        the peer's lifetime beside `attach`; channels wired later get their pump then)."""
        async with anyio.create_task_group() as tg:
            self._pumps = tg
            for inbound in self._inbound.values():
                tg.start_soon(self._pump, inbound)
            await anyio.sleep_forever()

    async def _pump(self, inbound: _Inbound) -> None:
        inbound.ready = anyio.Event()
        while True:
            if not inbound.overflow:
                await inbound.ready.wait()
            inbound.ready = anyio.Event()
            while inbound.overflow:
                try:
                    await inbound.sender.send(inbound.overflow[0])
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    inbound.overflow.clear()
                    return
                inbound.overflow.popleft()
                self._credit(inbound.index)
            if inbound.ended:
                inbound.sender.close()
                return

    def close_inbound(self) -> None:
        """This process stops: end every channel this peer feeds (it will send no more)."""
        for inbound in self._inbound.values():
            inbound.overflow.clear()
            inbound.sender.close()


class RemoteChannel:
    """The send side of a channel whose consumer runs in other processes (`peers`).

    It stands where a `Channel` stands in the producer's graph: stage tasks take
    `sender()` clones, the runtime closes the original, and the last clone to close sends
    `END`. A channel consumed by several peers of one replicated process splits each
    message between them with `route`.
    """

    def __init__(
        self, spec: ChannelSpec, peers: Sequence[Peer], route: Route | None = None
    ) -> None:
        self.name = spec.name
        self.message_type = spec.message_type
        self.capacity = spec.capacity
        self.peers = list(peers)
        self._route = route
        self._taps: list[Tap] = []
        self._accepts = type_members(spec.message_type)
        self._open = 1  # the original, until `close()`
        for peer in self.peers:
            peer.add_outbound(spec.name, spec.capacity)

    def __repr__(self) -> str:
        return (
            f"RemoteChannel({self.name!r}, {type_name(self.message_type)}, peers={len(self.peers)})"
        )

    def add_tap(self, tap: Tap) -> None:
        self._taps.append(tap)

    def depth(self) -> int:
        """Messages sent and not yet in the consumers' channels."""
        return sum(peer.in_transit(self.name) for peer in self.peers)

    def sender(self) -> RemoteSender:
        self._open += 1
        return RemoteSender(self)

    def close(self) -> None:
        self._release()

    def _release(self) -> None:
        self._open -= 1
        if self._open == 0:
            for peer in self.peers:
                peer.end(self.name)

    def parts(self, message: object) -> Sequence[tuple[Peer, object]]:
        if self._route is None:
            return [(peer, message) for peer in self.peers]
        return [(self.peers[index], part) for index, part in self._route(self.name, message)]


class RemoteSender:
    """One producer task's end of a `RemoteChannel` (what `ChannelSender` is locally)."""

    __slots__ = ("_closed", "channel")

    def __init__(self, channel: RemoteChannel) -> None:
        self.channel = channel
        self._closed = False

    def _check(self, message: object) -> None:
        channel = self.channel
        check_type(channel.name, channel.message_type, channel._accepts, message)

    async def send(self, message: object) -> None:
        self._check(message)
        now = perf_counter()
        name = self.channel.name
        for peer, part in self.channel.parts(message):
            await peer.send(name, part)
        for tap in self.channel._taps:
            tap(message, now)

    def send_nowait(self, message: object) -> None:
        self._check(message)
        if not self.has_room():
            raise anyio.WouldBlock
        now = perf_counter()
        name = self.channel.name
        for peer, part in self.channel.parts(message):
            peer.send_nowait(name, part)
        for tap in self.channel._taps:
            tap(message, now)

    def has_room(self) -> bool:
        return self.room() > 0

    def room(self) -> int:
        name = self.channel.name
        return min((peer.credits(name) for peer in self.channel.peers), default=0)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.channel._release()


class Boundary:
    """This process's peers by process name: where the runtime finds the far ends of its
    cross-process channels. `route` splits messages for a process that runs as several
    peers (fronts), and sees every message it sends even to one; without it, each message
    goes to every peer of the process."""

    def __init__(self, peers: dict[str, Sequence[Peer]], route: Route | None = None) -> None:
        self.peers = {process: list(ps) for process, ps in peers.items()}
        self._route = route

    def _of(self, process: str, channel: str) -> list[Peer]:
        peers = self.peers.get(process)
        if not peers:
            raise KeyError(f"channel {channel!r} needs process {process!r}, which has no peer")
        return peers

    def outbound(self, spec: ChannelSpec, process: str) -> RemoteChannel:
        """The send side of `spec`, whose consumer runs in `process`."""
        return RemoteChannel(spec, self._of(process, spec.name), self._route)

    def inbound(self, spec: ChannelSpec, channel: Channel[Any], processes: Sequence[str]) -> None:
        """Feed `channel` with what the peers of `processes` send on it (a sender clone
        each, taken before the runtime closes the channel's originals)."""
        for process in processes:
            for peer in self._of(process, spec.name):
                peer.add_inbound(spec.name, channel.sender(), spec.capacity)

    def all_peers(self) -> list[Peer]:
        return [peer for peers in self.peers.values() for peer in peers]
