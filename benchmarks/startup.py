"""Warm start: seconds from launching `flowllm serve` to its first healthy `/health`, and
where they go.

The bundled model is converted, its weights repacked and the kernels compiled before the
timed runs (one untimed start), so every timed run is a warm start as users see it after
the first. Optionally interleaves a second checkout (`--baseline DIR`) run for run, on
this machine's noise; each run prints the load average it started at.

`--quiet` waits before each run until the CPUs were 90 % idle for a second (other work on a
shared machine comes and goes; the load average lags it by a minute), and prints how idle.

`--first-requests` also times, once healthy, the first two completions (16 greedy tokens):
work a server leaves to its first request (an import, a compile) shows as the first one
taking longer than the second.

`--breakdown` starts each checkout once more under `python -X importtime` with every
process's stderr (its log and its import times) in a file of its own, and prints, per
process (the supervisor, the engine core, the front): when it started, its imports by
package, and its log lines, in seconds from the launch.

    .venv/bin/python benchmarks/startup.py                        # 5 runs of this checkout
    .venv/bin/python benchmarks/startup.py --baseline ../other    # alternate with another
    .venv/bin/python benchmarks/startup.py --runs 0 --breakdown   # only the breakdown
    .venv/bin/python benchmarks/startup.py --quiet --baseline ../other
    .venv/bin/python benchmarks/startup.py --quiet --first-requests --baseline ../other
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRACE_ENV = "FLOWLLM_STARTUP_TRACE"
# Imported first by every Python process of a traced start (the folder is on PYTHONPATH):
# its stderr goes to a file of its own, which starts with the process's start time.
SITECUSTOMIZE = f"""
import os, sys, time
folder = os.environ.get({TRACE_ENV!r})
if folder:
    fd = os.open(os.path.join(folder, f"{{os.getpid()}}.stderr"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stderr.write(f"started {{time.time()}}\\n")
"""
IMPORT_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \| (\s*)(\S+)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def idle_fraction(seconds: float = 1.0) -> float:
    """How idle the CPUs were over the next `seconds` (from /proc/stat)."""

    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return fields[3] + fields[4], sum(fields)  # idle + iowait, all

    idle0, total0 = sample()
    time.sleep(seconds)
    idle1, total1 = sample()
    return (idle1 - idle0) / max(1, total1 - total0)


def wait_until_quiet(threshold: float = 0.9, patience: float = 600.0) -> float:
    """Wait (up to `patience` seconds) for a second in which the CPUs were `threshold`
    idle; returns the last second's idle fraction."""
    deadline = time.monotonic() + patience
    idle = idle_fraction()
    while idle < threshold and time.monotonic() < deadline:
        idle = idle_fraction()
    return idle


def cpu_seconds(root: int) -> dict[int, float]:
    """The CPU time (user and system) used so far by `root` and each process under it."""
    parent_of, used = {}, {}
    tick = os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(stat.parent.name)
        parent_of[pid] = int(fields[1])
        used[pid] = (int(fields[11]) + int(fields[12])) / tick
    tree = {root}
    for _ in range(4):  # the supervisor's children, and theirs
        tree |= {pid for pid, parent in parent_of.items() if parent in tree}
    return {pid: used[pid] for pid in tree if pid in used}


def completion_seconds(port: int) -> float:
    """Seconds one completion of 16 greedy tokens takes."""
    body = json.dumps({"prompt": "The history of the printing press", "max_tokens": 16,
                       "temperature": 0, "ignore_eos": True}).encode()  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=body,
        headers={"content-type": "application/json"},
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()
    return time.perf_counter() - started


def time_to_healthy(
    checkout: Path,
    extra: list[str],
    timeout: float = 300.0,
    python_flags: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    cpu: dict[int, float] | None = None,
    requests: list[float] | None = None,
) -> float:
    """Launch, poll /health every 10 ms, stop; seconds until the first 200 (and into `cpu`,
    the CPU time each process had used by then; into `requests`, when given, the seconds
    of the first two completions after it)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(checkout), **(env or {})}
    log = tempfile.TemporaryFile()  # noqa: SIM115 - closed below, after the process
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, *python_flags, "-m", "flowllm", "serve", "--port", str(port), *extra],
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
                        healthy = time.perf_counter() - started
                        if cpu is not None:
                            cpu.update(cpu_seconds(process.pid))
                        if requests is not None:
                            requests += [completion_seconds(port), completion_seconds(port)]
                        return healthy
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


@dataclass
class ProcessTrace:
    """One process of a traced start: when it started, its imports, its log lines."""

    pid: int
    started: float  # seconds from the launch
    cpu: float = 0.0  # CPU seconds used by the first healthy /health
    imports: Counter[str] = field(default_factory=Counter)  # package -> seconds (self time)
    events: list[tuple[float, str]] = field(default_factory=list)  # (seconds, event)

    @property
    def role(self) -> str:
        text = " ".join(event for _, event in self.events)
        if "engine core ready" in text or "model weights" in text:
            return "engine core"
        if "flowllm serving" in text or "Started server process" in text:
            return "front"
        if "engine core started" in text:
            return "supervisor"
        return "other"


def read_trace(file: Path, launched: float) -> ProcessTrace:
    """A process's stderr file: the start line, `-X importtime` lines, JSON log lines."""
    lines = file.read_text(errors="replace").splitlines()
    first = lines[0].split() if lines else []
    started = float(first[1]) - launched if first[:1] == ["started"] else 0.0
    trace = ProcessTrace(int(file.stem), started)
    for line in lines[1:]:
        match = IMPORT_LINE.match(line)
        if match:
            trace.imports[match.group(4).split(".")[0]] += int(match.group(1)) / 1e6
            continue
        try:
            record = json.loads(line)
            stamp = datetime.datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00"))
        except (ValueError, KeyError, TypeError):
            continue
        trace.events.append((stamp.timestamp() - launched, str(record.get("event", ""))))
    return trace


def breakdown(checkout: Path, extra: list[str]) -> None:
    """One traced start of `checkout`, printed process by process."""
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "sitecustomize.py").write_text(SITECUSTOMIZE)
        traces = Path(folder) / "traces"
        traces.mkdir()
        env = {"PYTHONPATH": f"{checkout}{os.pathsep}{folder}", TRACE_ENV: str(traces)}
        launched = time.time()
        cpu: dict[int, float] = {}
        healthy = time_to_healthy(
            checkout, extra, python_flags=("-X", "importtime"), env=env, cpu=cpu
        )
        found = [read_trace(f, launched) for f in sorted(traces.glob("*.stderr"))]
    load = os.getloadavg()[0]
    print(f"\n{checkout}: healthy at {healthy:.2f} s under -X importtime (load {load:.2f})")
    for trace in sorted(found, key=lambda t: t.started):
        total = sum(trace.imports.values())
        top = ", ".join(f"{name} {s:.2f}" for name, s in trace.imports.most_common(8))
        print(
            f"  {trace.role} (pid {trace.pid}): started at {trace.started:.2f} s, "
            f"{cpu.get(trace.pid, 0.0):.2f} s of CPU by the first 200"
        )
        print(f"    imports {total:.2f} s: {top}")
        for at, event in trace.events:
            if "GET /health" not in event:
                print(f"    {at:6.2f}  {event[:90]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--baseline", type=Path, help="another checkout, alternated run by run")
    parser.add_argument(
        "--breakdown", action="store_true", help="then one traced start per checkout"
    )
    parser.add_argument(
        "--quiet", action="store_true", help="before each run, wait for a second of idle CPUs"
    )
    parser.add_argument(
        "--first-requests", action="store_true", help="time the first two completions too"
    )
    parser.add_argument("serve_args", nargs="*", help="extra `flowllm serve` arguments")
    args = parser.parse_args()
    checkouts = {"this": REPO}
    if args.baseline is not None:
        checkouts["baseline"] = args.baseline.resolve()
    for checkout in checkouts.values():
        time_to_healthy(checkout, args.serve_args)  # converts, repacks, compiles: not timed
    times: dict[str, list[float]] = {name: [] for name in checkouts}
    for run in range(args.runs):
        for name, checkout in checkouts.items():
            idle = f", {wait_until_quiet():.0%} idle before" if args.quiet else ""
            load = os.getloadavg()[0]
            requests: list[float] | None = [] if args.first_requests else None
            seconds = time_to_healthy(checkout, args.serve_args, requests=requests)
            times[name].append(seconds)
            answers = (
                f"; first two completions {requests[0]:.2f} s, {requests[1]:.2f} s"
                if requests
                else ""
            )
            print(
                f"run {run + 1} {name:9s} {seconds:.2f} s{answers}  "
                f"(load average {load:.2f}{idle})"
            )
    for name, values in times.items():
        if values:
            shown = ", ".join(f"{v:.2f}" for v in values)
            print(
                f"{name:9s} median {statistics.median(values):.2f} s  "
                f"min {min(values):.2f} s  ({shown})"
            )
    if args.breakdown:
        for checkout in checkouts.values():
            if args.quiet:
                wait_until_quiet()
            breakdown(checkout, args.serve_args)


if __name__ == "__main__":
    main()
