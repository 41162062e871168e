"""Addresses a process listens on: a Unix socket path or HOST:PORT, told apart by a `/`;
a TCP listener on port 0 reports the port it took, and its connections (both ends) carry
keepalives, so that a peer whose machine went away ends the connection."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import anyio
import pytest

from flowllm.engine.core import HELLO_MAX_BYTES
from flowllm.graph.transport import (
    connect,
    keep_alive,
    listen,
    receive,
    send_all,
    tcp_address,
    tcp_endpoint,
)
from flowllm.graph.wire import WireError, read_one_frame

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_addresses_are_paths_or_host_and_port() -> None:
    assert tcp_endpoint("/tmp/flowllm-x/core.sock") is None
    assert tcp_endpoint("./core.sock") is None
    assert tcp_endpoint("10.0.0.7:4000") == ("10.0.0.7", 4000)
    assert tcp_endpoint("node-3.cluster:65535") == ("node-3.cluster", 65535)
    assert tcp_endpoint("[::1]:80") == ("::1", 80)
    assert tcp_address("::1", 80) == "[::1]:80" and tcp_address("10.0.0.7", 1) == "10.0.0.7:1"
    for bad in ("core.sock", "host:", ":80", "host:http", "host:65536"):
        with pytest.raises(ValueError, match="neither a Unix socket path nor HOST:PORT"):
            tcp_endpoint(bad)


def _keepalive_on(sock: socket.socket) -> bool:
    return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE))


@pytest.mark.parametrize("tcp", [True, False], ids=["tcp", "unix"])
async def test_a_listener_reports_its_address_and_carries_bytes(tcp: bool, tmp_path: Path) -> None:
    listener, address = await listen("127.0.0.1:0" if tcp else str(tmp_path / "s.sock"))
    if tcp:
        endpoint = tcp_endpoint(address)
        assert endpoint is not None and endpoint[0] == "127.0.0.1" and endpoint[1] > 0
    else:
        assert address == str(tmp_path / "s.sock")
    accepted: list[bool] = []

    async def echo(sock: socket.socket) -> None:
        keep_alive(sock)
        accepted.append(_keepalive_on(sock))
        await send_all(sock, await receive(sock, 100))
        sock.close()

    async with anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, echo)
        sock = await connect(address)
        await send_all(sock, b"frame")
        assert await receive(sock, 100) == b"frame"
        assert _keepalive_on(sock) == tcp
        with pytest.raises(anyio.EndOfStream):  # the echo closed its end
            await receive(sock, 100)
        sock.close()
        tg.cancel_scope.cancel()
    await listener.aclose()
    assert accepted == [tcp]


async def test_nobody_listening_is_an_os_error(tmp_path: Path) -> None:
    listener, address = await listen("127.0.0.1:0")
    await listener.aclose()  # the port is free again: a dead core's
    with pytest.raises(OSError):
        await connect(address)
    with pytest.raises(OSError):
        await connect(str(tmp_path / "absent.sock"))


async def test_a_greeting_longer_than_its_bound_is_refused_before_it_is_read() -> None:
    """What an unauthenticated peer sends first is bounded by the core's greeting limit,
    not by a channel frame's: a header claiming 1 MiB fails at once, its body never
    awaited."""
    listener, address = await listen("127.0.0.1:0")
    outcome: list[BaseException] = []

    async def greet(sock: socket.socket) -> None:
        try:
            with anyio.fail_after(2):
                await read_one_frame(sock, HELLO_MAX_BYTES)
        except BaseException as exc:
            outcome.append(exc)
        sock.close()

    async with anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, greet)
        sock = await connect(address)
        await send_all(sock, struct.pack("<I", 1 << 20))  # a length, and no body behind it
        with anyio.fail_after(5):
            while not outcome:
                await anyio.sleep(0.01)
        sock.close()
        tg.cancel_scope.cancel()
    await listener.aclose()
    assert isinstance(outcome[0], WireError), outcome
    assert f"at most {HELLO_MAX_BYTES}" in str(outcome[0])
