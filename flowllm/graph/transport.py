"""Where a process's peers reach it: a Unix socket path, or HOST:PORT over TCP.

The frames of flowllm/graph/wire.py read the same from either byte stream. Processes on
one machine talk over a Unix socket: nothing else can connect when its folder is
private, and its end is the peer's death, seen at once. A process on another machine (a
Ray replica's engine core) is reached over TCP, with keepalives and a bound on
unacknowledged data, so that a peer whose machine went away ends the connection within
seconds as a dead process's socket does.

An address with a `/` is a Unix socket path; otherwise it is `HOST:PORT` (`[V6]:PORT`
for an IPv6 host). Port 0 listens on a free port: `listen` returns the address taken.
"""

from __future__ import annotations

import socket

import anyio
import anyio.abc
from anyio.abc import SocketAttribute

CONNECT_TIMEOUT_S = 10.0
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


async def listen(address: str) -> tuple[anyio.abc.Listener[anyio.abc.SocketStream], str]:
    """A listener on `address`, and the address it listens on (the port a :0 got). Pass
    each stream it accepts to `keep_alive`."""
    endpoint = tcp_endpoint(address)
    if endpoint is None:
        return await anyio.create_unix_listener(address), address
    host, port = endpoint
    listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
    bound = listener.listeners[0].extra(SocketAttribute.local_port)
    return listener, tcp_address(host, bound)


async def connect(address: str) -> anyio.abc.SocketStream:
    """A stream to the process listening on `address` (OSError when none answers)."""
    endpoint = tcp_endpoint(address)
    if endpoint is None:
        return await anyio.connect_unix(address)
    with anyio.fail_after(CONNECT_TIMEOUT_S):
        stream = await anyio.connect_tcp(*endpoint)
    keep_alive(stream)
    return stream


def keep_alive(stream: anyio.abc.SocketStream) -> None:
    """Turn a TCP stream's keepalives on (a Unix socket's needs none)."""
    sock = stream.extra(SocketAttribute.raw_socket)
    if sock.family == socket.AF_UNIX:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in _KEEPALIVE:
        option = getattr(socket, name, None)  # Linux's; elsewhere the system's defaults
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)
