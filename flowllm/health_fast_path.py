"""`GET /health` answered outside the server's process, so a probe never queues behind a
burst of connections.

The event loop handles connections in arrival order: when thousands arrive at once, a
probe waits until the loop has accepted, parsed and answered every connection ahead of it,
and an orchestrator may take a busy server for a dead one. A thread of the same process
does not help: each of its socket calls waits for the interpreter lock that the busy loop
holds. So a small process of its own, the *door*, accepts the server's connections and
looks at each one's first bytes without consuming them (`MSG_PEEK`):

- a plain `GET /health` or `HEAD /health` (no body) while the server is healthy is answered
  there, `200` with `connection: close`;
- every other connection, and every probe while the server is not healthy, is passed to
  the server's event loop as an open descriptor (`SCM_RIGHTS`), untouched: the loop's HTTP
  protocol reads the same bytes, and the app answers (the 503 and its error JSON come from
  the app alone).

The server sends its health to the door on every tick of its loop (`HealthDoorProcess.
publish`); a door that has heard nothing for `STALE_AFTER_S` leaves probes to the loop,
so answering elsewhere cannot hide a stalled loop. The door exits when the server closes
its end (or dies); if the door dies, the server accepts in its loop again. Plain HTTP on
Linux only: with TLS, the loop accepts connections itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Literal

import structlog

# A connection whose first bytes say nothing yet is passed on after this long: the loop's
# HTTP protocol has its own timeouts for slow clients.
UNDECIDED_TIMEOUT_S = 1.0
# A request head longer than this is no probe; the loop reads it.
MAX_PROBE_BYTES = 4096
# The server publishes health every tick of its loop (0.1 s); heard from longer ago than
# this, the loop has stalled, and probes are left to it (it answers when it can).
STALE_AFTER_S = 2.0
# Descriptors per message to the server (the kernel's limit per message is 253).
MAX_FDS_PER_MESSAGE = 200

_PROBE_LINE = re.compile(rb"(?:GET|HEAD) /health(?:\?[^ \r\n]*)? HTTP/1\.[01]\r\n")
_BODY_HEADER = re.compile(rb"\r\n(?:content-length|transfer-encoding)\s*:", re.IGNORECASE)
_PROBE_PREFIXES = (b"GET /health", b"HEAD /health")
_HEALTHY = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: 0\r\nconnection: close\r\n\r\n"
)
_SELECT_TICK_S = 0.1

Action = Literal["probe", "wait", "close", "loop"]


def classify(head: bytes) -> Action:
    """What to do with a connection whose first bytes are `head`: "probe" (answer it),
    "wait" (too few bytes to tell), "close" (the client left without a word) or "loop"
    (pass it on)."""
    if not head:
        return "close"
    end = head.find(b"\r\n\r\n")
    if end < 0:
        if len(head) >= MAX_PROBE_BYTES:
            return "loop"
        if b"\r\n" not in head:
            could_be_probe = any(p.startswith(head) or head.startswith(p) for p in _PROBE_PREFIXES)
            return "wait" if could_be_probe else "loop"
        return "wait" if _PROBE_LINE.match(head) else "loop"
    request_head = head[: end + 2]
    if _PROBE_LINE.match(request_head) and not _BODY_HEADER.search(request_head):
        return "probe"
    return "loop"


class HealthDoor:
    """The door process's work (see the module doc): accept on `listeners`, answer probes,
    pass everything else over `server` (a SOCK_SEQPACKET socket) until the server hangs up."""

    def __init__(self, listeners: list[socket.socket], server: socket.socket) -> None:
        self._listeners = listeners
        self._server = server
        self._selector = selectors.DefaultSelector()
        self._undecided: dict[socket.socket, float] = {}  # connection -> accepted at
        self._to_pass: list[socket.socket] = []  # passed at the end of each round
        self._healthy = False
        self._heard_at = float("-inf")  # time.monotonic() of the server's last word

    def run(self) -> None:
        for listener in self._listeners:
            listener.setblocking(False)
            self._selector.register(listener, selectors.EVENT_READ, "listener")
        self._server.setblocking(False)
        self._selector.register(self._server, selectors.EVENT_READ, "server")
        while self._hear_server_alive_or_not():
            for key, _ in self._selector.select(_SELECT_TICK_S):
                if key.data == "listener":
                    self._accept(key.fileobj)  # type: ignore[arg-type]
                elif key.data == "connection":
                    self._decide(key.fileobj)  # type: ignore[arg-type]
            self._pass_overdue()
            self._pass_on()

    def _hear_server_alive_or_not(self) -> bool:
        """Read the server's health messages; False once it has hung up."""
        while True:
            try:
                message = self._server.recv(64)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                return False
            if not message:
                return False
            self._healthy = message[-1:] == b"1"
            self._heard_at = time.monotonic()

    def _fresh_and_healthy(self) -> bool:
        return self._healthy and time.monotonic() - self._heard_at < STALE_AFTER_S

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # none left, out of descriptors, or reset before accept
                return
            conn.setblocking(False)
            self._undecided[conn] = time.monotonic()
            self._selector.register(conn, selectors.EVENT_READ, "connection")

    def _decide(self, conn: socket.socket) -> None:
        try:
            head = conn.recv(MAX_PROBE_BYTES, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            head = b""
        action = classify(head)
        if action == "wait":
            return
        self._forget(conn)
        if action == "probe" and self._fresh_and_healthy():
            with contextlib.suppress(OSError), conn:
                conn.recv(head.index(b"\r\n\r\n") + 4)  # consumed: the close sends no RST
                conn.sendall(_HEALTHY)
        elif action == "close":
            conn.close()
        else:
            self._to_pass.append(conn)

    def _pass_overdue(self) -> None:
        """The oldest come first (`_undecided` is in accept order): stop at the first that
        may still wait, so a round costs what it passes, not what is pending."""
        deadline = time.monotonic() - UNDECIDED_TIMEOUT_S
        while self._undecided:
            conn, accepted_at = next(iter(self._undecided.items()))
            if accepted_at >= deadline:
                return
            self._forget(conn)
            self._to_pass.append(conn)

    def _pass_on(self) -> None:
        while self._to_pass:
            batch = self._to_pass[:MAX_FDS_PER_MESSAGE]
            try:
                socket.send_fds(self._server, [b"c"], [conn.fileno() for conn in batch])
            except (BlockingIOError, InterruptedError):
                return  # the server is busy: the rest go in a later round
            except OSError:
                return  # the server hung up: the next round ends the door
            del self._to_pass[:MAX_FDS_PER_MESSAGE]
            for conn in batch:
                conn.close()  # the server holds its own descriptor now

    def _forget(self, conn: socket.socket) -> None:
        del self._undecided[conn]
        self._selector.unregister(conn)


class HealthDoorProcess:
    """The server's side of the door: starts it on `listeners` (which it owns from then
    on), adopts the connections it passes (`adopt`, called on the event loop), and
    publishes health to it. If the door dies, the loop accepts on `listeners` itself."""

    def __init__(
        self, listeners: list[socket.socket], adopt: Callable[[socket.socket], None]
    ) -> None:
        self._listeners = listeners
        self._adopt = adopt
        self._loop: asyncio.AbstractEventLoop | None = None
        self._control: socket.socket | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._log = structlog.get_logger("flowllm.health")

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fds = [theirs.fileno(), *(listener.fileno() for listener in self._listeners)]
        self._process = subprocess.Popen(
            [sys.executable, "-m", "flowllm.health_fast_path", *map(str, fds)], pass_fds=fds
        )
        theirs.close()
        ours.setblocking(False)
        self._control = ours
        loop.add_reader(ours.fileno(), self._receive)

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def publish(self, healthy: bool) -> None:
        if self._control is not None:
            with contextlib.suppress(OSError):  # full or gone: the door sees it as stale
                self._control.send(b"1" if healthy else b"0")

    def _receive(self) -> None:
        assert self._control is not None
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(self._control, 16, MAX_FDS_PER_MESSAGE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                message, fds = b"", []
            for fd in fds:
                self._adopt(socket.socket(fileno=fd))
            if not message:
                self._door_exited()
                return

    def _door_exited(self) -> None:
        self._log.error("health fast path exited; the event loop accepts connections itself")
        self._close_control()
        assert self._loop is not None
        for listener in self._listeners:
            listener.setblocking(False)
            self._loop.add_reader(listener.fileno(), self._accept_in_loop, listener)

    def _accept_in_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            self._adopt(conn)

    def _close_control(self) -> None:
        if self._control is not None and self._loop is not None:
            self._loop.remove_reader(self._control.fileno())
            self._control.close()
            self._control = None

    def stop(self) -> None:
        """Stop accepting: the door hangs up and exits, and `listeners` are closed."""
        self._close_control()
        for listener in self._listeners:
            if self._loop is not None:
                self._loop.remove_reader(listener.fileno())
            listener.close()
        if self._process is not None:
            try:
                self._process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()


def main(argv: list[str]) -> None:
    """`python -m flowllm.health_fast_path SERVER_FD LISTENER_FD...`, started by
    `HealthDoorProcess`: signals go to the server, which ends the door by hanging up."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    server = socket.socket(fileno=int(argv[0]))
    listeners = [socket.socket(fileno=int(fd)) for fd in argv[1:]]
    HealthDoor(listeners, server).run()


if __name__ == "__main__":
    main(sys.argv[1:])
