"""Where a process's peers reach it: a Unix socket path, or HOST:PORT over TCP.

The frames of flowllm/graph/wire.py read the same from either byte stream. Processes on
one machine talk over a Unix socket: nothing else can connect when its folder is
private, and its end is the peer's death, seen at once. A process on another machine (a
Ray replica's engine core) is reached over TCP, with keepalives and a bound on
unacknowledged data, so that a peer whose machine went away ends the connection within
seconds as a dead process's socket does.

An address with a `/` is a Unix socket path; otherwise it is `HOST:PORT` (`[V6]:PORT`
for an IPv6 host). Port 0 listens on a free port: `listen` returns the address taken.

A connection is a plain non-blocking socket, read and written through the event loop
(`receive`, `send_all`, or a `FrameLink` once greeted: flowllm/graph/link.py), so that
nothing but the link's own callbacks watches it while frames flow.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
from collections.abc import Callable, Coroutine
from typing import Any

import anyio

CONNECT_TIMEOUT_S = 10.0
_BACKLOG = 128
# A TCP peer whose machine answers nothing for this long is gone: idle for KEEPIDLE, then
# KEEPCNT unanswered probes KEEPINTVL apart; data unacknowledged for USER_TIMEOUT ms.
_KEEPALIVE = (
    ("TCP_KEEPIDLE", 5),
    ("TCP_KEEPINTVL", 2),
    ("TCP_KEEPCNT", 3),
    ("TCP_USER_TIMEOUT", 15_000),
)


def tcp_endpoint(address: str) -> tuple[str, int] | None:
    """(host, port) of a `HOST:PORT` address, None for a Unix socket path; raises
    ValueError for what is neither."""
    if "/" in address:
        return None
    host, colon, port = address.rpartition(":")
    if not colon or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{address!r} is neither a Unix socket path nor HOST:PORT")
    return host.removeprefix("[").removesuffix("]"), int(port)


def tcp_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Listener:
    """A listening socket; `serve` hands each connection to a task of its own."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    async def serve(self, handler: Callable[[socket.socket], Coroutine[Any, Any, None]]) -> None:
        """Accept until cancelled; `handler` owns (and closes) each connected socket."""
        loop = asyncio.get_running_loop()
        async with anyio.create_task_group() as tg:
            while True:
                conn, _ = await loop.sock_accept(self._sock)
                conn.setblocking(False)
                _no_delay(conn)
                tg.start_soon(handler, conn)

    async def aclose(self) -> None:
        self._sock.close()


async def listen(address: str) -> tuple[Listener, str]:
    """A listener on `address`, and the address it listens on (the port a :0 got). Pass
    each socket it accepts to `keep_alive`."""
    endpoint = tcp_endpoint(address)
    if endpoint is None:
        _remove_stale_socket(address)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bind_to: str | tuple[Any, ...] = address
    else:
        host, port = endpoint
        family, kind, proto, _, bind_to = (
            await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        )[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.setblocking(False)
        sock.bind(bind_to)
        sock.listen(_BACKLOG)
    except OSError:
        sock.close()
        raise
    if endpoint is None:
        return Listener(sock), address
    return Listener(sock), tcp_address(endpoint[0], sock.getsockname()[1])


def _remove_stale_socket(path: str) -> None:
    """A socket file left by a process that died takes the path: remove it."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)


async def connect(address: str) -> socket.socket:
    """A socket connected to the process listening on `address` (OSError when none
    answers)."""
    endpoint = tcp_endpoint(address)
    target: str | tuple[Any, ...]
    if endpoint is None:
        family, kind, proto, target = socket.AF_UNIX, socket.SOCK_STREAM, 0, address
    else:
        family, kind, proto, _, target = (
            await anyio.getaddrinfo(*endpoint, type=socket.SOCK_STREAM)
        )[0]
    sock = socket.socket(family, kind, proto)
    sock.setblocking(False)
    try:
        with anyio.fail_after(CONNECT_TIMEOUT_S):
            await asyncio.get_running_loop().sock_connect(sock, target)
    except BaseException:
        sock.close()
        raise
    _no_delay(sock)
    keep_alive(sock)
    return sock


async def receive(sock: socket.socket, max_bytes: int) -> bytes:
    """Up to `max_bytes` from `sock`; raises `anyio.EndOfStream` once the peer has closed."""
    data = await asyncio.get_running_loop().sock_recv(sock, max_bytes)
    if not data:
        raise anyio.EndOfStream
    return data


async def send_all(sock: socket.socket, data: bytes) -> None:
    await asyncio.get_running_loop().sock_sendall(sock, data)


def _no_delay(sock: socket.socket) -> None:
    """Small frames leave at once on TCP (no waiting to fill a segment)."""
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def keep_alive(sock: socket.socket) -> None:
    """Turn a TCP socket's keepalives on (a Unix socket's needs none)."""
    if sock.family == socket.AF_UNIX:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in _KEEPALIVE:
        option = getattr(socket, name, None)  # Linux's; elsewhere the system's defaults
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)
