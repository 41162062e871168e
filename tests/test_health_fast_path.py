"""The health door on real sockets: probes answered by the door, everything else passed to
the server as a descriptor with its bytes unread, and the server's health obeyed; and the
door as a process beside an event loop, which accepts by itself once the door is gone."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from flowllm import health_fast_path
from flowllm.health_fast_path import HealthDoor, HealthDoorProcess, classify

PROBE = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"


@pytest.mark.parametrize(
    ("head", "action"),
    [
        (PROBE, "probe"),
        (b"HEAD /health HTTP/1.1\r\nhost: x\r\n\r\n", "probe"),
        (b"GET /health?full=1 HTTP/1.0\r\n\r\n", "probe"),
        (b"GET /healthz HTTP/1.1\r\n\r\n", "loop"),
        (b"GET /health HTTP/1.1\r\ncontent-length: 3\r\n\r\nabc", "loop"),
        (b"GET /health HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", "loop"),
        (b"POST /health HTTP/1.1\r\n\r\n", "loop"),
        (b"POST /v1/completions HTTP/1.1\r\n", "loop"),
        (b"GE", "wait"),
        (b"GET /hea", "wait"),
        (b"GET /health HTTP/1.1\r\nhost: x\r\n", "wait"),
        (b"GET /v1/models", "loop"),
        (b"GET /health HTTP/1.1\r\n" + b"x-pad: " + b"a" * 5000, "loop"),
        (b"", "close"),
    ],
)
def test_classify(head: bytes, action: str) -> None:
    assert classify(head) == action


class Door:
    """A door in a thread on an ephemeral port; the test is its server."""

    def __init__(self) -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        self.port = listener.getsockname()[1]
        self.server, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.thread = threading.Thread(target=HealthDoor([listener], theirs).run, daemon=True)
        self.thread.start()

    def publish(self, healthy: bool) -> None:
        self.server.send(b"1" if healthy else b"0")
        time.sleep(0.05)  # heard before the next connection

    def connect(self, data: bytes) -> socket.socket:
        client = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        client.sendall(data)
        return client

    def passed(self, timeout: float = 5.0) -> socket.socket:
        """The next connection the door passes on."""
        self.server.settimeout(timeout)
        message, fds, _, _ = socket.recv_fds(self.server, 16, 8)
        assert message == b"c" and len(fds) == 1
        conn = socket.socket(fileno=fds[0])
        conn.settimeout(5)
        return conn

    def nothing_passed(self) -> bool:
        self.server.settimeout(0.3)
        try:
            socket.recv_fds(self.server, 16, 8)
        except TimeoutError:
            return True
        return False

    def close(self) -> None:
        self.server.close()  # the door hangs up
        self.thread.join(timeout=5)
        assert not self.thread.is_alive()


@pytest.fixture
def door() -> Iterator[Door]:
    made = Door()
    made.publish(True)
    yield made
    made.close()


def read_all(client: socket.socket) -> bytes:
    chunks = []
    while chunk := client.recv(4096):
        chunks.append(chunk)
    return b"".join(chunks)


def test_a_probe_is_answered_by_the_door_and_closed(door: Door) -> None:
    with door.connect(PROBE) as client:
        answer = read_all(client)
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"connection: close" in answer and answer.endswith(b"\r\n\r\n")
    assert door.nothing_passed()


def test_anything_else_reaches_the_server_unread(door: Door) -> None:
    request = b"POST /v1/completions HTTP/1.1\r\ncontent-length: 2\r\n\r\n{}"
    with door.connect(request) as client, door.passed() as conn:
        assert conn.recv(4096) == request  # only peeked: the server reads every byte
        conn.sendall(b"answer")
        assert client.recv(16) == b"answer"


def test_a_probe_split_across_packets_is_still_answered(door: Door) -> None:
    with door.connect(PROBE[:7]) as client:
        time.sleep(0.2)
        client.sendall(PROBE[7:])
        assert read_all(client).startswith(b"HTTP/1.1 200 OK")
    assert door.nothing_passed()


def test_an_unhealthy_server_gets_its_probes() -> None:
    door = Door()
    try:
        door.publish(False)
        with door.connect(PROBE), door.passed() as conn:
            assert conn.recv(4096) == PROBE
    finally:
        door.close()


def test_a_server_not_heard_from_lately_gets_its_probes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(health_fast_path, "STALE_AFTER_S", 0.2)
    door = Door()
    try:
        door.publish(True)
        time.sleep(0.3)
        with door.connect(PROBE), door.passed() as conn:
            assert conn.recv(4096) == PROBE
    finally:
        door.close()


def test_a_silent_connection_is_passed_after_the_timeout(
    door: Door, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(health_fast_path, "UNDECIDED_TIMEOUT_S", 0.2)
    with door.connect(b"GET /hea"), door.passed(timeout=2) as conn:
        assert conn.recv(16) == b"GET /hea"


def test_many_connections_are_passed_in_batches(door: Door) -> None:
    count = health_fast_path.MAX_FDS_PER_MESSAGE + 50
    clients = [door.connect(b"GET / HTTP/1.1\r\n\r\n") for _ in range(count)]
    received = 0
    door.server.settimeout(5)
    while received < count:
        message, fds, _, _ = socket.recv_fds(door.server, 16, count)
        assert message == b"c" and 1 <= len(fds) <= health_fast_path.MAX_FDS_PER_MESSAGE
        received += len(fds)
        for fd in fds:
            os.close(fd)
    for client in clients:
        client.close()


async def answer_from_the_loop(conn: socket.socket, request_start: bytes) -> None:
    loop = asyncio.get_running_loop()
    with conn:
        conn.setblocking(False)
        received = await asyncio.wait_for(loop.sock_recv(conn, 4096), 5)
        assert received.startswith(request_start)
        await loop.sock_sendall(conn, b"from the loop")


@pytest.mark.anyio
async def test_the_door_process_passes_to_the_loop_and_the_loop_takes_over_when_it_dies() -> None:
    loop = asyncio.get_running_loop()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    adopted: asyncio.Queue[socket.socket] = asyncio.Queue()
    door = HealthDoorProcess([listener], adopted.put_nowait)
    door.start(loop)
    try:

        async def exchange(data: bytes) -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(data)
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            return answer

        door.publish(True)
        await asyncio.sleep(0.3)  # the door's interpreter starts
        assert (await exchange(PROBE)).startswith(b"HTTP/1.1 200 OK")
        served = asyncio.ensure_future(exchange(b"GET /v1/models HTTP/1.1\r\n\r\n"))
        await answer_from_the_loop(await asyncio.wait_for(adopted.get(), 5), b"GET /v1/models")
        assert await served == b"from the loop"

        assert door.pid is not None
        os.kill(door.pid, signal.SIGKILL)  # a door that dies: the loop accepts itself
        await asyncio.sleep(0.3)
        probe = asyncio.ensure_future(exchange(PROBE))
        await answer_from_the_loop(await asyncio.wait_for(adopted.get(), 5), PROBE)
        assert await probe == b"from the loop"
    finally:
        door.stop()
