"""What the reliability tests share: the scale they run at, the server's leftover state
from /metrics, its resident memory, /health latency, and failure messages that name the
request at fault.

Servers are started with tests/server_process.py and tests/e2e/e2e_helpers.py.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from server_process import process_tree

# `make test` runs the suite at "ci" scale; `make reliability` sets "full".
SCALE = os.environ.get("FLOWLLM_RELIABILITY_SCALE", "ci").strip().lower() or "ci"
if SCALE not in ("ci", "full"):
    raise RuntimeError(f"FLOWLLM_RELIABILITY_SCALE must be 'ci' or 'full', not {SCALE!r}")
FULL = SCALE == "full"


def scaled(ci: int, full: int) -> int:
    """`ci` at CI scale, `full` at full scale; FLOWLLM_RELIABILITY_FACTOR multiplies both
    (e.g. 0.1 for a quick local run)."""
    factor = float(os.environ.get("FLOWLLM_RELIABILITY_FACTOR", "1"))
    return max(1, round((full if FULL else ci) * factor))


def scale_seconds(ci: float, full: float) -> float:
    return full if FULL else ci


# Gauges of per-request state: every one is 0 when the server holds no request.
KV_USAGE = "flowllm:kv_cache_usage_perc"
RUNNING = "flowllm:num_requests_running"
WAITING = "flowllm:num_requests_waiting"
LIVE_MAILBOXES = "flowllm:live_mailboxes"
LIVE_SEQUENCES = "flowllm:live_sequences"
SEQUENCE_STAGES = ("schedule", "sample", "detokenize")
REQUIRED_GAUGES = (KV_USAGE, RUNNING, WAITING)

_SAMPLE = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*(?:\{[^}]*\})?) (\S+)")


def scrape(url: str, timeout: float = 5.0) -> dict[str, float]:
    """Every sample of /metrics by name, labels included (`name{stage="sample"}`)."""
    text = httpx.get(f"{url}/metrics", timeout=timeout).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.fullmatch(line)
        if match:
            values[match.group(1)] = float(match.group(2))
    return values


@dataclass
class Leftovers:
    """The per-request state gauges at one scrape."""

    values: dict[str, float]

    @property
    def nonzero(self) -> dict[str, float]:
        return {name: value for name, value in self.values.items() if value != 0}

    @property
    def clean(self) -> bool:
        return not self.nonzero


def leftovers(url: str) -> Leftovers:
    """The per-request state gauges now; fails if /metrics lacks one of them."""
    samples = scrape(url)
    values = {name: samples[name] for name in (*REQUIRED_GAUGES, LIVE_MAILBOXES) if name in samples}
    # Every live_sequences sample counts, whatever its labels; each stage must have one.
    sequences = {k: v for k, v in samples.items() if k.startswith(LIVE_SEQUENCES + "{")}
    values.update(sequences)
    missing = [name for name in (*REQUIRED_GAUGES, LIVE_MAILBOXES) if name not in samples]
    for stage in SEQUENCE_STAGES:
        if not any(f'stage="{stage}"' in name for name in sequences):
            missing.append(f'{LIVE_SEQUENCES}{{stage="{stage}"}}')
    if missing:
        raise AssertionError(f"/metrics lacks {missing}")
    return Leftovers(values)


def wait_for_no_leftovers(url: str, timeout: float = 2.0) -> Leftovers:
    """Scrape until no KV block is used and no request, mailbox or sequence is held,
    at most `timeout` seconds; returns the last scrape (check `.clean`)."""
    deadline = time.monotonic() + timeout
    while True:
        state = leftovers(url)
        if state.clean or time.monotonic() >= deadline:
            return state
        time.sleep(0.05)


HEAP_TRIMS = "flowllm:heap_trims_total"


def wait_for_heap_trim(url: str, trims_before_load: float, timeout: float = 10.0) -> float:
    """Wait for the heap trim of the idle period just begun (the engine trims once, a second
    after its last step): until the count of trims rises past its value now, or, when that
    trim came before this first scrape, `timeout` seconds. Returns the count, which must
    exceed `trims_before_load` (the count before the load whose heap it gives back)."""
    start = scrape(url).get(HEAP_TRIMS, 0.0)
    deadline = time.monotonic() + timeout
    while True:
        trims = scrape(url).get(HEAP_TRIMS, 0.0)
        if trims > start or time.monotonic() >= deadline:
            assert trims > trims_before_load, f"no heap trim after the load ({trims})"
            return trims
        time.sleep(0.05)


def assert_no_leftovers(url: str, timeout: float = 2.0, context: str = "") -> Leftovers:
    start = time.monotonic()
    state = wait_for_no_leftovers(url, timeout)
    assert state.clean, (
        f"per-request state left {time.monotonic() - start:.2f} s after the last request"
        f"{' (' + context + ')' if context else ''}: {state.nonzero}"
    )
    return state


def rss_mb(pid: int) -> float:
    """VmRSS of a server's processes (`pid` and its descendants), in MiB."""
    return sum(_status_kib(p, "VmRSS:") for p in process_tree(pid)) / 1024


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a server's processes have used so far."""
    total = 0
    for p in process_tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _status_kib(pid: int, key: str) -> int:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0  # it exited meanwhile
    for line in lines:
        if line.startswith(key):
            return int(line.split()[1])
    return 0


def cap_memory(pid: int, headroom_mb: int = 3072) -> int:
    """Limit each of a running server's processes' data segment (RLIMIT_DATA) to what it
    has now plus `headroom_mb`, so that a request that makes it allocate without bound gets
    a MemoryError instead of taking the shared machine's memory; returns the largest limit
    in MiB."""
    largest = 0
    for p in process_tree(pid):
        limit_mb = _status_kib(p, "VmData:") // 1024 + headroom_mb
        resource.prlimit(p, resource.RLIMIT_DATA, (limit_mb << 20, limit_mb << 20))
        largest = max(largest, limit_mb)
    return largest


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


class HealthPoller:
    """Polls GET /health from a process of its own (so the test's own load does not delay
    it) every `interval` seconds until `stop()`, which returns every latency and status."""

    def __init__(self, url: str, interval: float = 0.02) -> None:
        script = Path(__file__).with_name("health_poller.py")
        self._process = subprocess.Popen(
            [sys.executable, str(script), url, str(interval)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )

    def stop(self) -> HealthSamples:
        out, err = self._process.communicate(b"stop\n", timeout=30)
        if self._process.returncode != 0:
            raise RuntimeError(f"health poller failed: {err.decode(errors='replace')}")
        data = json.loads(out)
        return HealthSamples(
            latencies=data["latencies"],
            sent_at=data["sent_at"],
            failures=data["failures"],
            lags=data["lags"],
        )


@dataclass
class HealthSamples:
    latencies: list[float]  # seconds, of the 200s
    sent_at: list[float]  # when each of those was sent, time.monotonic()
    failures: list[str]  # anything but a 200: status or exception, with its time
    lags: list[float]  # seconds each of the poller's sleeps overran: the machine's delay

    def sent_between(self, start: float, end: float) -> list[float]:
        """The latencies of the 200s sent from `start` to `end` (time.monotonic())."""
        return [
            latency
            for latency, sent in zip(self.latencies, self.sent_at, strict=True)
            if start <= sent <= end
        ]

    def summary(self) -> str:
        if not self.latencies:
            return f"no /health answered; failures: {self.failures[:5]}"
        return (
            f"{len(self.latencies)} polls, p50 {percentile(self.latencies, 50) * 1000:.1f} ms, "
            f"p99 {percentile(self.latencies, 99) * 1000:.1f} ms, "
            f"max {max(self.latencies) * 1000:.1f} ms, {len(self.failures)} failures; "
            f"the poller's own wake-ups up to {max(self.lags, default=0) * 1000:.1f} ms late"
        )


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes


async def raw_post(port: int, path: str, body: bytes, timeout: float = 120.0) -> RawResponse:
    """One POST over a fresh connection with `Connection: close`, read to the end.

    Lighter than an HTTP client library, so one test process can hold thousands at once."""
    import asyncio

    async def exchange() -> RawResponse:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(
                f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
            raw = await reader.read()
        finally:
            writer.close()
        head, _, payload = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding") == "chunked":
            payload = _dechunk(payload)
        return RawResponse(status, headers, payload)

    return await asyncio.wait_for(exchange(), timeout)


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += rest[:size]
        data = rest[size + 2 :]
    return bytes(out)


def report(name: str, figures: dict[str, Any]) -> None:
    """Print a test's measured figures (pytest shows them with -s, or `-rA` in the summary);
    with FLOWLLM_RELIABILITY_REPORT=FILE they are also appended to FILE as JSON lines."""
    line = json.dumps({"test": name, "scale": SCALE, **figures}, sort_keys=True)
    print(f"\nreliability figures: {line}")
    target = os.environ.get("FLOWLLM_RELIABILITY_REPORT")
    if target:
        with open(target, "a") as out:
            out.write(line + "\n")
