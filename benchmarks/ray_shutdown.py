"""Seconds from SIGTERM to exit of an idle `flowllm serve --distributed-executor-backend ray`.

Each run starts a server on a Ray cluster of its own (2 replicas x 1 thread of a tiny
random GPT-2, built once into a temporary directory), waits for /health, lets it idle
for `--idle` seconds, sends SIGTERM and times the exit; then checks that no process it
started is left. `--baseline DIR` alternates another checkout run by run, on this
machine's noise; `--env NAME=VALUE` (repeatable) sets Serve's environment, e.g.
`RAY_SERVE_ENABLE_DIRECT_INGRESS=1`. The load average is printed with each run.

    PYTHONPATH=. .venv/bin/python benchmarks/ray_shutdown.py --runs 5 --baseline ../main
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "scale_out")]

from ray_helpers import alive, descendants  # noqa: E402  (the tests' own, from /proc)

from flowllm.models.random_gpt2 import build_gpt2_dir  # noqa: E402

STARTUP_TIMEOUT_S = 300.0
EXIT_TIMEOUT_S = 120.0
FLAGS = [
    "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "64MiB",
    "--distributed-executor-backend", "ray", "--data-parallel-size", "2",
    "--cpus-per-replica", "1", "--cpu-threads", "1",
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def time_to_exit(
    checkout: Path, model: Path, env: dict[str, str], idle: float
) -> tuple[float, int | None, int]:
    """Start, wait until healthy, idle, SIGTERM: (seconds to exit, exit code, processes
    still running 5 s after the exit)."""
    port = free_port()
    full_env = {**os.environ, **env, "PYTHONPATH": str(checkout), "HF_HUB_OFFLINE": "1"}
    log = tempfile.TemporaryFile()  # noqa: SIM115 - closed below, after the process
    process = subprocess.Popen(
        [sys.executable, "-m", "flowllm", "serve", str(model), "--port", str(port), *FLAGS],
        cwd=checkout,
        env=full_env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                tail = log.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"{checkout}: serve did not start:\n{tail}")
            time.sleep(0.1)
        time.sleep(idle)
        started = descendants(process.pid)
        signalled = time.perf_counter()
        process.send_signal(signal.SIGTERM)
        try:
            code: int | None = process.wait(EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        took = time.perf_counter() - signalled
        time.sleep(5.0)
        return took, code, len(alive(started))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--idle", type=float, default=2.0, help="seconds idle before SIGTERM")
    parser.add_argument("--baseline", type=Path, help="another checkout, alternated run by run")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the server")
    args = parser.parse_args()
    env = {"RAY_memory_monitor_refresh_ms": "0"}  # the machine's memory is shared
    for item in args.env:
        name, _, value = item.partition("=")
        env[name] = value
    checkouts = {"this": REPO}
    if args.baseline is not None:
        checkouts["baseline"] = args.baseline.resolve()

    times: dict[str, list[float]] = {name: [] for name in checkouts}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_gpt2_dir(Path(tmp), seed=0, n_layer=2, n_embd=64, n_head=4)
        for run in range(args.runs):
            for name, checkout in checkouts.items():
                took, code, left = time_to_exit(checkout, model, env, args.idle)
                load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
                print(
                    f"run {run} {name:8s} {took:6.2f} s  exit {code}  left {left}  load {load}",
                    flush=True,
                )
                times[name].append(took)
    for name, values in times.items():
        shown = ", ".join(f"{v:.2f}" for v in values)
        print(f"{name:8s} median {statistics.median(values):.2f} s  ({shown})")


if __name__ == "__main__":
    main()
