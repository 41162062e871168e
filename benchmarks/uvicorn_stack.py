"""uvicorn's event loop and HTTP parser under flowllm: uvloop + httptools against asyncio + h11.

Two `python -m flowllm serve` processes on one model, one per stack (`--uvicorn-loop`,
`--uvicorn-http`), both up for the whole run; rounds alternate which is measured first.
Each round sends each server `--burst` requests at once on new connections against a
full admission (the servers run a copy of the default graph whose ingest admits one
request without output) and measures the rate of answers, nearly all 503: what the
front's HTTP stack costs per request, the model aside.

    .venv/bin/python benchmarks/uvicorn_stack.py                       # the bundled model
    .venv/bin/python benchmarks/uvicorn_stack.py --model PATH --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
STACKS = {"uvloop+httptools": ("uvloop", "httptools"), "asyncio+h11": ("asyncio", "h11")}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(model: str | None, loop: str, http: str, graph: Path, log: Path) -> tuple[Any, int]:
    port = free_port()
    args = [sys.executable, "-m", "flowllm", "serve", *([model] if model else [])]
    args += ["--port", str(port), "--uvicorn-loop", loop, "--uvicorn-http", http]
    args += ["--graph", str(graph), "--disable-uvicorn-access-log"]
    process = subprocess.Popen(args, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=REPO)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process, port
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise SystemExit(f"server did not come up:\n{log.read_text()[-3000:]}")


async def _burst(port: int, count: int) -> float:
    body = b'{"prompt": "Hello", "max_tokens": 4}'
    request = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )

    async def one() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        await writer.drain()
        await reader.read()
        writer.close()

    started = time.monotonic()
    await asyncio.gather(*(one() for _ in range(count)))
    return count / (time.monotonic() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a model path or name (default: the bundled one)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--burst", type=int, default=1000)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="uvicorn-stack-"))
    graph = scratch / "graph.yaml"
    default = (REPO / "flowllm/engine/default.yaml").read_text()
    graph.write_text(default.replace("max_pending: 1024", "max_pending: 1"))
    servers = {
        name: start(args.model, loop, http, graph, scratch / f"{name}.log")
        for name, (loop, http) in STACKS.items()
    }
    figures: dict[str, list[float]] = {name: [] for name in STACKS}
    try:
        for round_ in range(args.rounds):
            order = list(STACKS) if round_ % 2 == 0 else list(reversed(STACKS))
            for name in order:
                _, port = servers[name]
                rate = asyncio.run(_burst(port, args.burst))
                figures[name].append(rate)
                print(f"round {round_ + 1} {name:18} {rate:8.0f} answers/s", flush=True)
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(30)
    print(f"\nload average {os.getloadavg()[0]:.1f}; medians:")
    for name, rates in figures.items():
        print(f"  {name:18} {statistics.median(rates):8.0f} answers/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
