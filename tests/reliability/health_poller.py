"""Probe URL/health every INTERVAL seconds until a line arrives on stdin, then print the
latencies of the 200s with when each was sent (`time.monotonic()`, a clock every process
on the machine shares), every other outcome, and how late each of the poller's own
wake-ups came (the machine's scheduling delay) as JSON:
`python health_poller.py URL INTERVAL`.

Each probe is a new connection, as an orchestrator's probe is. The latency runs from
sending the request, once connected, to the end of the answer: what the server takes,
not how long this process took to be scheduled between connecting and sending.

Run as a process of its own by `reliability_helpers.HealthPoller`, so the load the test
itself generates does not delay the probe.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from urllib.parse import urlsplit

TIMEOUT_S = 5.0


def probe(host: str, port: int) -> tuple[int, float, float]:
    """GET /health on a new connection: (status, when it was sent, seconds from sending to
    the answer)."""
    with socket.create_connection((host, port), timeout=TIMEOUT_S) as conn:
        request = f"GET /health HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n"
        started = time.monotonic()
        conn.sendall(request.encode())
        chunks = []
        while chunk := conn.recv(4096):
            chunks.append(chunk)
        elapsed = time.monotonic() - started
    status_line = b"".join(chunks).split(b"\r\n", 1)[0].split()
    if len(status_line) < 2:
        raise ConnectionError(f"no HTTP answer: {status_line!r}")
    return int(status_line[1]), started, elapsed


def main() -> None:
    url, interval = urlsplit(sys.argv[1]), float(sys.argv[2])
    host, port = url.hostname or "127.0.0.1", url.port or 80
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    latencies: list[float] = []
    sent_at: list[float] = []
    failures: list[str] = []
    lags: list[float] = []
    started = time.monotonic()
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            status, sent, elapsed = probe(host, port)
        except OSError as exc:
            failures.append(f"{t0 - started:.2f}s: {type(exc).__name__}: {exc}")
        else:
            if status == 200:
                latencies.append(elapsed)
                sent_at.append(sent)
            else:
                failures.append(f"{t0 - started:.2f}s: status {status} in {elapsed:.3f}s")
        slept = time.monotonic()
        stop.wait(interval)
        lags.append(max(0.0, time.monotonic() - slept - interval))
    json.dump(
        {"latencies": latencies, "sent_at": sent_at, "failures": failures, "lags": lags},
        sys.stdout,
    )


if __name__ == "__main__":
    main()
