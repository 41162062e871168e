"""A `FrameLink` carries frames both ways over one socket, in order, driven by the event
loop's callbacks: a frame larger than the socket takes at once waits for room without
blocking anything, the owner's extra frames (credits) ride with each send, what
`on_frame` raises or a malformed stream ends the link, and a peer that hangs up ends it."""

from __future__ import annotations

import socket
import struct

import anyio
import pytest

from flowllm.graph.link import FrameLink
from flowllm.graph.wire import CONTROL, CREDIT, DATA, Frame, WireError, encode_frame

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _pair() -> tuple[socket.socket, socket.socket]:
    left, right = socket.socketpair(socket.AF_UNIX)
    left.setblocking(False)
    right.setblocking(False)
    return left, right


async def test_frames_cross_in_order_and_a_large_one_waits_for_room() -> None:
    left, right = _pair()
    got: list[Frame] = []
    big = "x" * (8 << 20)  # far more than a socket buffer holds
    sent = [encode_frame(DATA, 1, 0, i) for i in range(3)]
    sent += [encode_frame(DATA, 2, 0, big), encode_frame(CONTROL, 0, 0, "after")]
    async with anyio.create_task_group() as tg:
        sender = FrameLink(left, lambda frame: None)
        receiver = FrameLink(right, got.append)
        tg.start_soon(sender.run)
        tg.start_soon(receiver.run)
        await anyio.sleep(0)
        for frame in sent:
            sender.write(frame)
        with anyio.fail_after(10):
            while len(got) < len(sent):
                await anyio.sleep(0.01)
        sender.close()
        with anyio.fail_after(5):  # the socket's owner closes it; the far end sees it end
            await anyio.sleep(0)
            left.close()
            while receiver.open:
                await anyio.sleep(0.01)
    assert [(f.kind, f.channel) for f in got] == [(DATA, 1)] * 3 + [(DATA, 2), (CONTROL, 0)]
    assert [bytes(f.payload) for f in got[:3]] == [b"\x00", b"\x01", b"\x02"]
    assert len(bytes(got[3].payload)) > 8 << 20
    right.close()


async def test_extra_frames_leave_with_the_next_send_or_on_their_own() -> None:
    left, right = _pair()
    owed = [3]
    got: list[Frame] = []

    def credits() -> list[bytes]:
        frames = [encode_frame(CREDIT, 5, owed[0])] if owed[0] else []
        owed[0] = 0
        return frames

    async with anyio.create_task_group() as tg:
        sender = FrameLink(left, lambda frame: None, credits)
        receiver = FrameLink(right, got.append)
        tg.start_soon(sender.run)
        tg.start_soon(receiver.run)
        await anyio.sleep(0)
        sender.write(encode_frame(DATA, 1, 0, "a"))  # the credits ride along
        with anyio.fail_after(5):
            while len(got) < 2:
                await anyio.sleep(0.01)
        owed[0] = 2
        sender.send_soon()  # nothing written: the credits go alone
        with anyio.fail_after(5):
            while len(got) < 3:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert [(f.kind, f.channel, f.member) for f in got] == [
        (DATA, 1, 0),
        (CREDIT, 5, 3),
        (CREDIT, 5, 2),
    ]
    left.close()
    right.close()


async def test_what_on_frame_raises_ends_the_link_and_run_raises_it() -> None:
    left, right = _pair()

    def refuse(frame: Frame) -> None:
        raise ValueError(f"no frames of kind {frame.kind}")

    receiver = FrameLink(right, refuse)
    left.send(encode_frame(CONTROL, 0, 0, "hello"))
    with anyio.fail_after(5), pytest.raises(ValueError, match="no frames of kind 3"):
        await receiver.run()
    assert not receiver.open
    left.close()
    right.close()


async def test_a_frame_longer_than_the_bound_is_a_wire_error() -> None:
    left, right = _pair()
    receiver = FrameLink(right, lambda frame: None)
    left.send(struct.pack("<I", 1 << 30))  # a length past MAX_FRAME_BYTES
    with anyio.fail_after(5), pytest.raises(WireError, match="at most"):
        await receiver.run()
    left.close()
    right.close()


async def test_a_peer_that_hangs_up_ends_the_link() -> None:
    left, right = _pair()
    receiver = FrameLink(right, lambda frame: None)
    left.close()
    with anyio.fail_after(5):
        await receiver.run()  # returns: no error, the peer is gone
    assert not receiver.open
    receiver.write(encode_frame(DATA, 1))  # after the end: dropped, nothing raised
    await anyio.sleep(0)
    right.close()
