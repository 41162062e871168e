"""Warm start: seconds from launching `flowllm serve` to its first healthy `/health`.

The bundled model is converted and the kernels are compiled before the timed runs (one
untimed start), so every timed run is a warm start as users see it after the first.
Optionally interleaves a second checkout (`--baseline DIR`) run for run, on this machine's
noise.

    .venv/bin/python benchmarks/startup.py                     # 5 runs of this checkout
    .venv/bin/python benchmarks/startup.py --baseline ../other  # alternate with another
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def time_to_healthy(checkout: Path, extra: list[str], timeout: float = 300.0) -> float:
    """Launch, poll /health every 10 ms, stop; seconds until the first 200."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    log = tempfile.TemporaryFile()  # noqa: SIM115 - closed below, after the process
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "flowllm", "serve", "--port", str(port), *extra],
        cwd=checkout,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - started
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if process.poll() is not None:
                log.seek(0)
                tail = log.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"{checkout}: serve exited ({process.returncode}):\n{tail}")
            if time.perf_counter() - started > timeout:
                raise RuntimeError("flowllm serve did not become healthy")
            time.sleep(0.01)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--baseline", type=Path, help="another checkout, alternated run by run")
    parser.add_argument("serve_args", nargs="*", help="extra `flowllm serve` arguments")
    args = parser.parse_args()
    checkouts = {"this": REPO}
    if args.baseline is not None:
        checkouts["baseline"] = args.baseline.resolve()
    for checkout in checkouts.values():
        time_to_healthy(checkout, args.serve_args)  # converts, compiles: not timed
    times: dict[str, list[float]] = {name: [] for name in checkouts}
    for _ in range(args.runs):
        for name, checkout in checkouts.items():
            times[name].append(time_to_healthy(checkout, args.serve_args))
    for name, values in times.items():
        shown = ", ".join(f"{v:.2f}" for v in values)
        print(
            f"{name:9s} median {statistics.median(values):.2f} s  min {min(values):.2f} s  "
            f"({shown})"
        )


if __name__ == "__main__":
    main()
