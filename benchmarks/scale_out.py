"""Data-parallel replicas on Ray (docs/scale-out.md): routing, and the 2-core throughput.

Two measurements, each side by side in one run, servers one at a time on 127.0.0.1:

1. **Routing.** `flowllm serve --distributed-executor-backend ray --data-parallel-size 2`
   with `--routing prefix_aware` and with `--routing round_robin`, alternating for
   `--rounds` rounds. The workload: `--prefixes` shared prefixes (distinct text, about
   `--prefix-words` words each) x `--requests-per-prefix` requests, each prefix followed
   by a question of its own, shuffled (seeded), streamed at `--concurrency`. Reported: the
   replicas' prefix-cache hit rate (hits / queries, from /metrics, summed over replicas)
   and the median time to first token seen by the client. Each replica's KV cache
   (`--kv-cache-memory`) holds about half the prefixes at once: the case routing is for,
   where the replicas' caches together hold what one cannot. `--imbalance-bound` is the
   servers' `--routing-imbalance-bound`.
2. **Throughput.** 2 replicas x 1 torch thread (Ray) against 1 plain server x 2 threads,
   on distinct prompts (`--throughput-requests` of them, `--output-len` tokens each, at
   `--concurrency`): output tokens per second, and the CPU seconds the server's processes
   spent per 1000 of them, in all and by the ingress, the replicas and the rest (Ray's
   own processes, the launcher; a plain server's all count there), medians of `--rounds`
   alternating rounds. On a machine other work loads, the CPU time moves less than the
   rate.

`--baseline DIR` runs every Ray measurement with another checkout too (its servers from
DIR, in the same rounds, the order alternating), so that a change to the Ray backend is
measured against what it replaces on the same machine's noise.

    PYTHONPATH=. .venv/bin/python benchmarks/scale_out.py [--baseline ../main]

The model defaults to the bundled SmolLM2-135M-Instruct (converted once into the flowllm
cache). The load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
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
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "scale_out")]

from ray_helpers import descendants  # noqa: E402  (the tests' own, from /proc)

WORDS = [
    "river",
    "mountain",
    "signal",
    "harbor",
    "lantern",
    "orchard",
    "copper",
    "meadow",
    "engine",
    "library",
    "window",
    "garden",
    "thunder",
    "pencil",
    "silver",
    "bridge",
    "market",
    "compass",
    "forest",
    "winter",
    "journal",
    "canyon",
    "violet",
    "rocket",
    "quiet",
    "summer",
    "marble",
    "anchor",
    "velvet",
    "island",
    "crystal",
    "shadow",
]
STARTUP_TIMEOUT_S = 300.0
_SAMPLE = re.compile(r'([A-Za-z_:][A-Za-z0-9_:]*)\{replica="\d+"\} (\S+)')


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """One `flowllm serve` subprocess of `checkout`, healthy on enter, stopped (SIGTERM) on
    exit."""

    def __init__(self, model: str, flags: list[str], checkout: Path = REPO) -> None:
        self.checkout = checkout
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [
            sys.executable, "-m", "flowllm", "serve", model, "--port", str(self.port),
            "--log-level", "warning", "--disable-uvicorn-access-log", *flags,
        ]  # fmt: skip
        self.log = tempfile.TemporaryFile()  # noqa: SIM115  (closed in __exit__)

    def __enter__(self) -> Server:
        env = {**os.environ, "PYTHONPATH": str(self.checkout), "HF_HUB_OFFLINE": "1"}
        self.process = subprocess.Popen(
            self.args, cwd=self.checkout, env=env, stdout=self.log, stderr=self.log
        )
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"server exited:\n{self.log.read().decode(errors='replace')}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("server not healthy in time")

    def __exit__(self, *exc: object) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()

    def replica_sums(self) -> dict[str, float]:
        """Every replica-labelled sample of /metrics, summed over replicas, by name."""
        sums: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            match = _SAMPLE.fullmatch(line)
            if match:
                sums[match.group(1)] = sums.get(match.group(1), 0.0) + float(match.group(2))
        return sums


async def _stream(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[float, int]:
    """(time to first token, output tokens) of one streamed completion."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.monotonic()
    ttft = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if ttft is None and '"text"' in line:
                ttft = time.monotonic() - started
            if '"usage":{' in line and '"choices":[]' in line:
                tokens = int(re.search(r'"completion_tokens":(\d+)', line).group(1))  # type: ignore[union-attr]
    return ttft or 0.0, tokens


async def _run(url: str, prompts: list[str], max_tokens: int, concurrency: int) -> list[Any]:
    limit = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def one(prompt: str) -> tuple[float, int]:
            async with limit:
                return await _stream(client, prompt, max_tokens)

        return await asyncio.gather(*(one(p) for p in prompts))


def routing_prompts(args: argparse.Namespace) -> list[str]:
    rng = random.Random(args.seed)
    prefixes = [
        f"Document {k}. " + " ".join(rng.choice(WORDS) for _ in range(args.prefix_words))
        for k in range(args.prefixes)
    ]
    prompts = [
        f"{prefix}\nQuestion {i}: what does word {i} of document {k} say?"
        for k, prefix in enumerate(prefixes)
        for i in range(args.requests_per_prefix)
    ]
    rng.shuffle(prompts)
    return prompts


def measure_routing(args: argparse.Namespace, policy: str, checkout: Path) -> dict[str, float]:
    flags = [
        *args.server_flags, "--distributed-executor-backend", "ray",
        "--data-parallel-size", "2", "--cpu-threads", "1", "--routing", policy,
        "--routing-imbalance-bound", str(args.imbalance_bound),
    ]  # fmt: skip
    with Server(args.model, flags, checkout) as server:
        asyncio.run(_run(server.url, ["Warm up."], 4, 1))
        time.sleep(1.5)  # a baseline's replicas' metrics reach its ingress with a probe
        before = server.replica_sums()
        results = asyncio.run(
            _run(server.url, routing_prompts(args), args.routing_output_len, args.concurrency)
        )
        time.sleep(1.5)
        after = server.replica_sums()
    hits = after["flowllm:prefix_cache_hits_total"] - before["flowllm:prefix_cache_hits_total"]
    queries = (
        after["flowllm:prefix_cache_queries_total"] - before["flowllm:prefix_cache_queries_total"]
    )
    return {
        "hit_rate": hits / queries if queries else 0.0,
        "median_ttft_s": statistics.median(ttft for ttft, _ in results),
    }


CPU_GROUPS = ("ingress", "replicas", "rest")  # the rest: Ray's processes, the launcher


def _cpu_group(pid: int) -> str:
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    if b"ServeReplica:flowllm:ingress" in cmdline:
        return "ingress"
    return "replicas" if b"ServeReplica:flowllm:engine" in cmdline else "rest"


def cpu_seconds(pid: int) -> dict[str, float]:
    """User and system CPU time of `pid` and every live process under it (Ray's too), by
    `CPU_GROUPS`."""
    seconds = dict.fromkeys(CPU_GROUPS, 0.0)
    for process in {pid, *descendants(pid)}:
        try:
            fields = Path(f"/proc/{process}/stat").read_text().rsplit(")", 1)[1].split()
            group = _cpu_group(process)
        except OSError:
            continue
        seconds[group] += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return seconds


def measure_throughput(
    args: argparse.Namespace, layout: str, checkout: Path
) -> tuple[float, dict[str, float]]:
    """(output tokens per second, CPU seconds of the server's processes per 1000 output
    tokens by `CPU_GROUPS`): CPU time counts what the work cost, whatever else ran."""
    if layout == "2x1":
        flags = [
            *args.server_flags, "--distributed-executor-backend", "ray",
            "--data-parallel-size", "2", "--cpu-threads", "1",
        ]  # fmt: skip
    else:
        flags = [*args.server_flags, "--cpu-threads", "2"]
    rng = random.Random(args.seed + 1)
    prompts = [
        f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(32))
        for i in range(args.throughput_requests)
    ]
    with Server(args.model, flags, checkout) as server:
        asyncio.run(_run(server.url, ["Warm up."], 4, 1))
        before = cpu_seconds(server.process.pid)
        started = time.monotonic()
        results = asyncio.run(_run(server.url, prompts, args.output_len, args.concurrency))
        elapsed = time.monotonic() - started
        after = cpu_seconds(server.process.pid)
    tokens = sum(tokens for _, tokens in results)
    return tokens / elapsed, {g: 1000 * (after[g] - before[g]) / tokens for g in CPU_GROUPS}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--requests-per-prefix", type=int, default=16)
    parser.add_argument("--prefix-words", type=int, default=300)
    parser.add_argument("--routing-output-len", type=int, default=8)
    parser.add_argument("--throughput-requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-memory", default="64MiB")
    parser.add_argument("--imbalance-bound", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-routing", action="store_true")
    parser.add_argument("--baseline", type=Path, help="another checkout, measured alongside")
    args = parser.parse_args()
    args.server_flags = [
        "--kv-cache-memory", args.kv_cache_memory, "--max-model-len", str(args.max_model_len)
    ]  # fmt: skip
    checkouts = {"this": REPO}
    if args.baseline is not None:
        checkouts["baseline"] = args.baseline.resolve()

    def alternated(settings: list[tuple[str, str]], round_index: int) -> list[tuple[str, str]]:
        return settings if round_index % 2 == 0 else settings[::-1]

    loads: list[float] = []
    routing: dict[tuple[str, str], list[dict[str, float]]] = {
        (c, p): [] for c in checkouts for p in ("prefix_aware", "round_robin")
    }
    for round_index in range(0 if args.skip_routing else args.rounds):
        for checkout, policy in alternated(list(routing), round_index):
            routing[checkout, policy].append(measure_routing(args, policy, checkouts[checkout]))
            loads.append(os.getloadavg()[0])
            result = routing[checkout, policy][-1]
            print(f"round {round_index} {checkout} {policy}: {result}", end=" ")
            print(f"load {loads[-1]:.2f}", flush=True)
    layouts = [(c, "2x1") for c in checkouts] + [("this", "1x2")]
    throughput: dict[tuple[str, str], list[tuple[float, dict[str, float]]]] = {
        key: [] for key in layouts
    }
    if not args.skip_throughput:
        for round_index in range(args.rounds):
            for checkout, layout in alternated(layouts, round_index):
                rate, cpu = measure_throughput(args, layout, checkouts[checkout])
                throughput[checkout, layout].append((rate, cpu))
                loads.append(os.getloadavg()[0])
                print(f"round {round_index} {checkout} {layout}: {rate:.1f} tok/s", end=" ")
                shares = ", ".join(f"{g} {cpu[g]:.2f}" for g in CPU_GROUPS)
                print(f"CPU s/1k tokens {sum(cpu.values()):.2f} ({shares})", end=" ")
                print(f"load {loads[-1]:.2f}", flush=True)

    print(
        f"\nload average (1 min) after each run: {min(loads):.2f}-{max(loads):.2f}; "
        f"rounds: {args.rounds}"
    )
    if not args.skip_routing:
        print("\n| checkout | routing | prefix-cache hit rate | median TTFT |")
        print("|---|---|---|---|")
        for (checkout, policy), runs in routing.items():
            rate = statistics.median(r["hit_rate"] for r in runs)
            ttft = statistics.median(r["median_ttft_s"] for r in runs)
            print(f"| {checkout} | {policy} | {rate:.1%} | {ttft * 1000:.0f} ms |")
    if not args.skip_throughput:
        names = {"2x1": "2 replicas x 1 thread (Ray)", "1x2": "1 server x 2 threads"}
        print(
            "\n| checkout | layout | output tokens/s | CPU s / 1k tokens: all, "
            + ", ".join(CPU_GROUPS)
            + " |"
        )
        print("|---|---|---|---|")
        for (checkout, layout), runs in throughput.items():
            rate = statistics.median(r for r, _ in runs)
            cpu = [statistics.median(sum(c.values()) for _, c in runs)]
            cpu += [statistics.median(c[g] for _, c in runs) for g in CPU_GROUPS]
            shown = ", ".join(f"{c:.2f}" for c in cpu)
            print(f"| {checkout} | {names[layout]} | {rate:.1f} | {shown} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
