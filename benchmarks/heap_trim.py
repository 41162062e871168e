"""What the idle heap trim (`flowllm.stages.idle_heap_trim`) costs and gives back after a
burst: how long glibc's `malloc_trim(0)` runs, and the server's RSS before and after it.

One `flowllm serve` per setting (the native kernels, the default; the torch path,
`FLOWLLM_NATIVE_KERNELS=0`; more with `--settings`), all up at once, on the tests' tiny
GPT-2 (2 layers, 64 wide, random weights, the real tokenizer; `--model DIR` for another)
with the storm test's flags. Each round sends every server in turn a burst of
`--requests` completions, `--concurrency` at a time, of random prompt lengths, `n` and
`max_tokens`, so that steps bring many row counts, then waits for the trim the idle
server makes a second later and reads its debug log line (duration, bytes returned,
resident bytes after). What the trim costs the next request: a probe (a 400-token prompt,
16 tokens) sent 0.8 s after the burst, on the heap as the burst left it, and another right
after the trim, on the trimmed heap; the ratio of their latencies. Round 0 is not
reported: its trim also gives back start-up's heap.

    .venv/bin/python benchmarks/heap_trim.py
    .venv/bin/python benchmarks/heap_trim.py --rounds 5 --settings native,torch,avx2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from server_process import TINY_FLAGS, ServerProcess

from flowllm.models.random_gpt2 import build_gpt2_dir

SETTINGS = {
    "native": {},
    "torch": {"FLOWLLM_NATIVE_KERNELS": "0"},
    "avx2": {"FLOWLLM_NATIVE_ISA": "avx2"},
}
HEAP_TRIMS = "flowllm:heap_trims_total"
TRIM_TIMEOUT_S = 60.0


def trims(server: ServerProcess) -> float:
    return float(server.metrics().get(HEAP_TRIMS, 0.0))


def last_trim(server: ServerProcess) -> dict[str, float]:
    """The server's newest "heap trimmed" log record (found by its content: a line may
    carry another thread's record too)."""
    decoder = json.JSONDecoder()
    for line in reversed(server.output().splitlines()):
        if '"heap trimmed"' not in line:
            continue
        for start in (i for i, char in enumerate(line) if char == "{"):
            try:
                record, _ = decoder.raw_decode(line, start)
            except ValueError:
                continue
            if record.get("event") == "heap trimmed":
                return dict(record)
    raise RuntimeError(f"no heap trim in the log:\n{server.output()[-2000:]}")


async def burst(server: ServerProcess, requests: int, concurrency: int, seed: int) -> None:
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient) -> None:
        prompt = [rng.randrange(1, 50000) for _ in range(rng.randint(4, 400))]
        body = {"prompt": prompt, "max_tokens": rng.choice((8, 32, 64)),
                "n": rng.choice((1, 1, 2)), "ignore_eos": True, "temperature": 1.0}  # fmt: skip
        async with gate:
            response = await client.post("/v1/completions", json=body, timeout=300)
        response.raise_for_status()

    async with httpx.AsyncClient(base_url=server.url) as client:
        await asyncio.gather(*(one(client) for _ in range(requests)))


def probe_ms(server: ServerProcess) -> float:
    body = {"prompt": list(range(1, 401)), "max_tokens": 16, "ignore_eos": True}
    started = time.perf_counter()
    httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).raise_for_status()
    return (time.perf_counter() - started) * 1e3


def round_on(server: ServerProcess, args: argparse.Namespace, seed: int) -> dict[str, float]:
    """One burst, the probes around the idle trim, and the trim's figures (MB and ms)."""
    before = trims(server)
    asyncio.run(burst(server, args.requests, args.concurrency, seed))
    time.sleep(0.8)  # idle as long as the next probe will have been, below the trim's second
    untrimmed = probe_ms(server)
    deadline = time.monotonic() + TRIM_TIMEOUT_S
    while trims(server) <= before:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no heap trim within {TRIM_TIMEOUT_S} s of the burst")
        time.sleep(0.1)
    trimmed = probe_ms(server)
    record = last_trim(server)
    after = record["resident_bytes"] / 2**20
    returned = record["returned_bytes"] / 2**20
    return {"ms": record["ms"], "rss_before": after + returned, "rss_after": after,
            "returned": returned, "probe_untrimmed": untrimmed, "probe_trimmed": trimmed,
            "probe_ratio": trimmed / untrimmed}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a model directory (default: tiny GPT-2)")
    parser.add_argument("--settings", default="native,torch", help=f"of {', '.join(SETTINGS)}")
    parser.add_argument("--rounds", type=int, default=3, help="reported, after round 0")
    parser.add_argument("--requests", type=int, default=500, help="per burst")
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    names = args.settings.split(",")
    unknown = [name for name in names if name not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; known: {', '.join(SETTINGS)}")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_gpt2_dir(Path(tmp), n_layer=2, n_embd=64, n_head=4)
        flags = [*TINY_FLAGS, "--log-level", "debug", "--log-format", "json"]
        servers = {name: ServerProcess(model, flags, env=SETTINGS[name]) for name in names}
        try:
            for server in servers.values():
                server.wait_healthy()
            results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
            for r in range(args.rounds + 1):
                for name in names if r % 2 == 0 else reversed(names):
                    figures = round_on(servers[name], args, seed=r)
                    if r:
                        results[name].append(figures)
            load = os.getloadavg()
        finally:
            for server in servers.values():
                server.stop()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; median over "
          f"{args.rounds} bursts of {args.requests} requests (min-max)")  # fmt: skip
    columns = {"ms": "trim ms", "rss_before": "RSS before MB", "rss_after": "RSS after MB",
               "returned": "returned MB", "probe_untrimmed": "probe ms, kept",
               "probe_trimmed": "probe ms, trimmed", "probe_ratio": "trimmed/kept"}  # fmt: skip
    print(f"{'setting':>8} " + " ".join(f"{title:>18}" for title in columns.values()))
    for name, rows in results.items():
        cells = []
        for key in columns:
            values = [row[key] for row in rows]
            low, mid, high = min(values), statistics.median(values), max(values)
            digits = 2 if key == "probe_ratio" else 1
            cells.append(f"{mid:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})")
        print(f"{name:>8} " + " ".join(f"{cell:>18}" for cell in cells))


if __name__ == "__main__":
    main()
