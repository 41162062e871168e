"""One connection's frames, moved by the event loop's own callbacks.

A cross-process channel crosses a socket once or twice every step (a step's tokens one
way, their credit the other), so what each crossing costs the step loop counts. A stream
read by a task costs a task switch per chunk and registers the socket with the selector
again for every read that waits; a writer task costs another switch per write. Here the
socket stays registered for reading while the connection lasts and each chunk is parsed
in the selector's callback; writes made during one pass of the event loop leave in one
`send` at its end (nothing waits on a full socket: what it does not take goes out when it
is writable again).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from flowllm.graph.wire import Frame, FrameReader

_READ_CHUNK = 1 << 16


class FrameLink:
    """Frames to and from one connected, non-blocking socket.

    `on_frame` is called with each frame read, in the event loop; what it raises ends the
    link, and `run` raises it. `extra_frames` is asked, at each write, for frames to send
    with those written since the last (the receiver's credits, gathered per pass).
    """

    def __init__(
        self,
        sock: socket.socket,
        on_frame: Callable[[Frame], None],
        extra_frames: Callable[[], list[bytes]] = list,
    ) -> None:
        self._sock = sock
        self._on_frame = on_frame
        self._extra_frames = extra_frames
        self._loop = asyncio.get_running_loop()
        self._reader = FrameReader()
        self._out: list[bytes] = []  # written since the last send
        self._unsent = bytearray()  # what the socket did not take yet
        self._send_scheduled = False
        self._waiting_writable = False
        self._ended: asyncio.Future[None] = self._loop.create_future()

    @property
    def open(self) -> bool:
        return not self._ended.done()

    def write(self, frame: bytes) -> None:
        """Send `frame` at the end of this pass of the event loop (dropped once the link
        has ended: its peer is gone)."""
        if self.open:
            self._out.append(frame)
            self.send_soon()

    def send_soon(self) -> None:
        """Send what is written, and the extra frames, at the end of this pass."""
        if not self._send_scheduled and not self._waiting_writable and self.open:
            self._send_scheduled = True
            self._loop.call_soon(self._send)

    async def run(self) -> None:
        """Carry frames until the peer hangs up or `close()`; raises what `on_frame` raised."""
        self._loop.add_reader(self._sock, self._readable)
        try:
            await self._ended
        finally:
            self._end()
            self._loop.remove_reader(self._sock)
            if self._waiting_writable:
                self._loop.remove_writer(self._sock)

    def close(self) -> None:
        """Send what is written (as much as the socket takes now) and end the link (`run`
        returns); the socket stays open for its owner to close."""
        self._send()
        self._end()

    def _end(self, error: BaseException | None = None) -> None:
        if self._ended.done():
            return
        if error is None:
            self._ended.set_result(None)
        else:
            self._ended.set_exception(error)

    def _readable(self) -> None:
        try:
            chunk = self._sock.recv(_READ_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._end()  # reset by the peer: it is gone
            return
        if not chunk:
            self._end()
            return
        try:
            for frame in self._reader.feed(chunk):
                self._on_frame(frame)
        except Exception as exc:  # handed to `run`'s caller
            self._end(exc)

    def _send(self) -> None:
        self._send_scheduled = False
        if not self.open:
            return
        self._out.extend(self._extra_frames())
        if self._out:
            self._unsent += b"".join(self._out)
            self._out.clear()
        if not self._unsent:
            return
        try:
            sent = self._sock.send(self._unsent)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._end()  # the peer is gone; the reader sees it too
            return
        del self._unsent[:sent]
        if self._unsent and not self._waiting_writable:
            self._waiting_writable = True
            self._loop.add_writer(self._sock, self._writable)

    def _writable(self) -> None:
        self._send()
        if not self._unsent and self._waiting_writable:
            self._waiting_writable = False
            self._loop.remove_writer(self._sock)
