"""What a new connection costs: `GET /v1/models` on a fresh connection each time, one at a
time (latency) and from 32 clients at once (rate), against one or more running servers,
alternately, so that their figures come from the same minutes of a noisy machine.

    python benchmarks/new_connections.py http://127.0.0.1:8101 http://127.0.0.1:8102

Every connection goes through the health door's hand-over to the event loop
(flowllm/health_fast_path.py); kept-alive connections pay it once.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from urllib.parse import urlsplit

REQUEST = b"GET /v1/models HTTP/1.1\r\nhost: bench\r\nconnection: close\r\n\r\n"


async def one(host: str, port: int) -> float:
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(REQUEST)
    answer = await reader.read()
    writer.close()
    if not answer.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"unexpected answer: {answer[:80]!r}")
    return time.perf_counter() - started


async def sequential(host: str, port: int, count: int) -> list[float]:
    return [await one(host, port) for _ in range(count)]


async def concurrent(host: str, port: int, clients: int, per_client: int) -> float:
    started = time.perf_counter()
    await asyncio.gather(*(sequential(host, port, per_client) for _ in range(clients)))
    return clients * per_client / (time.perf_counter() - started)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("urls", nargs="+")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--count", type=int, default=300)
    args = parser.parse_args()
    targets = [(url, urlsplit(url)) for url in args.urls]
    for round_ in range(1, args.rounds + 1):
        for url, parts in targets:
            host, port = parts.hostname or "127.0.0.1", parts.port or 80
            latencies = sorted(await sequential(host, port, args.count))
            rate = await concurrent(host, port, 32, args.count // 32 + 1)
            p99 = latencies[int(len(latencies) * 0.99) - 1]
            print(
                f"round {round_} {url}: one at a time p50 "
                f"{statistics.median(latencies) * 1000:.2f} ms, p99 {p99 * 1000:.2f} ms; "
                f"32 at once {rate:.0f} requests/s"
            )


if __name__ == "__main__":
    asyncio.run(main())
