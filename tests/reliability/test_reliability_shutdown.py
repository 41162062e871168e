"""Stopping a loaded server (tests/e2e/test_e2e_shutdown.py covers one request in flight).

- SIGTERM under load from 32 clients (streaming and not, completions and chat, short, and
  long enough that the drain runs into `--shutdown-timeout`): the server exits 0 within
  `--shutdown-timeout` + 5 s without logging a traceback; every request either completes
  or gets an error (a status, a cut stream, a refused or closed connection); none hangs;
  and requests in flight at the signal are drained.
- A second SIGTERM or SIGINT during the drain ends the process within 3 s.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from reliability_helpers import RUNNING, cap_memory, raw_post, report, scale_seconds, scrape
from server_process import TINY_FLAGS, ServerProcess, wait_until

CLIENTS = 32
SECOND_SIGNAL_EXIT = 3.0  # seconds


@dataclass
class Outcome:
    kind: str
    request: str  # method, path and body
    started: float
    ended: float
    result: str  # "complete", "cut stream", "status 503", "refused", ...


KINDS = ("short", "short stream", "long stream", "long stream n=8", "chat stream", "chat")


def request_kinds(rng: random.Random, kinds: tuple[str, ...]) -> tuple[str, str, bytes]:
    kind = rng.choice(kinds)
    long = kind.startswith("long")
    fields: dict[str, object] = {"max_tokens": 480 if long else 16, "ignore_eos": True}
    if kind == "long stream n=8":  # 8 sequences of 480 tokens: seconds of work each
        fields["n"] = 8
    if kind.endswith("stream"):
        fields["stream"] = True
    if kind.startswith("chat"):
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": "Shut down"}], **fields}
    else:
        path = "/v1/completions"
        body = {"prompt": "Shut down gracefully", **fields}
    return kind, path, json.dumps(body).encode()


async def load(
    server: ServerProcess, stop_at: list[float], timeout: float, kinds: tuple[str, ...] = KINDS
) -> list[Outcome]:
    """CLIENTS clients sending requests back to back until the server is signalled; each
    request's outcome."""
    outcomes: list[Outcome] = []
    rng = random.Random(7)

    async def client() -> None:
        while not stop_at:
            kind, path, body = request_kinds(rng, kinds)
            started = time.monotonic()
            try:
                response = await raw_post(server.port, path, body, timeout=timeout)
            except TimeoutError:
                result = "HANG"
            except ConnectionRefusedError:
                result = "refused"
            except (OSError, ValueError, IndexError) as exc:
                result = f"connection error {type(exc).__name__}"
            else:
                result = f"status {response.status}"
                if response.status == 200:
                    text = response.body.decode(errors="replace")
                    done = "data: [DONE]" in text if "stream" in kind else text.endswith("}")
                    result = "complete" if done else "cut stream"
            request = f"POST {path} {body.decode()}"
            outcomes.append(Outcome(kind, request, started, time.monotonic(), result))

    await asyncio.gather(*(client() for _ in range(CLIENTS)))
    return outcomes


def start(
    gpt2_tiny_dir: Path, template: Path, log_dir: Path, shutdown_timeout: float
) -> ServerProcess:
    flags = ["--chat-template", str(template), "--shutdown-timeout", str(shutdown_timeout)]
    server = ServerProcess(
        str(gpt2_tiny_dir),
        [*TINY_FLAGS, *flags],
        log_dir=log_dir,  # kept for the failure message
    )
    try:
        server.wait_healthy()
        cap_memory(server.process.pid)
    except BaseException:
        server.stop()
        raise
    return server


async def wait_exit(server: ServerProcess, timeout: float) -> tuple[int | None, float]:
    """(exit code or None if still running after `timeout`, seconds waited)."""
    started = time.monotonic()
    try:
        code = await asyncio.to_thread(server.process.wait, timeout)
    except subprocess.TimeoutExpired:
        code = None
    return code, time.monotonic() - started


async def until_busy(server: ServerProcess, sequences: int) -> None:
    def busy() -> bool:
        return scrape(server.url).get(RUNNING, 0) >= sequences

    assert await asyncio.to_thread(wait_until, busy, 30), "the load never got going"


@pytest.mark.anyio
async def test_sigterm_under_load_drains_and_exits_0(
    gpt2_tiny_dir: Path, reliability_template: Path, tmp_path: Path
) -> None:
    shutdown_timeout = 5.0
    server = start(gpt2_tiny_dir, reliability_template, tmp_path, shutdown_timeout)
    stop_at: list[float] = []
    try:
        clients = asyncio.ensure_future(load(server, stop_at, shutdown_timeout + 20))
        await until_busy(server, 8)
        await asyncio.sleep(scale_seconds(2, 10))
        server.process.send_signal(signal.SIGTERM)
        stop_at.append(time.monotonic())
        code, waited = await wait_exit(server, shutdown_timeout + 5)
        outcomes = await asyncio.wait_for(clients, shutdown_timeout + 30)
    finally:
        server.stop(signal.SIGKILL)
    log = server.output()
    signalled = stop_at[0]
    in_flight = [o for o in outcomes if o.started < signalled < o.ended]
    results = collections.Counter(o.result for o in outcomes)
    drained = collections.Counter(f"{o.kind}: {o.result}" for o in in_flight)
    report(
        "sigterm under load",
        {
            "shutdown_timeout": shutdown_timeout,
            "exit_code": code,
            "exit_seconds": round(waited, 2),
            "requests": len(outcomes),
            "results": dict(sorted(results.items())),
            "in_flight_at_sigterm": dict(sorted(drained.items())),
        },
    )
    assert code is not None, f"still running {waited:.1f} s after SIGTERM:\n{log[-3000:]}"
    assert code == 0, f"exit code {code}:\n{log[-3000:]}"
    assert waited < shutdown_timeout + 5
    hung = [f"{o.request} (sent {signalled - o.started:.1f} s before SIGTERM)" for o in outcomes
            if o.result == "HANG"]  # fmt: skip
    assert not hung, f"{len(hung)} requests hung through the shutdown:\n" + "\n".join(hung[:10])
    assert "Traceback" not in log, f"the server logged a traceback while stopping:\n{log[-3000:]}"
    # The drain: requests in flight at the signal went on to finish.
    finished = sum(n for key, n in drained.items() if key.endswith(": complete"))
    assert finished >= 1, f"nothing in flight was drained: {drained}"


@pytest.mark.anyio
@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_second_signal_during_the_drain_exits_at_once(
    gpt2_tiny_dir: Path, reliability_template: Path, tmp_path: Path, second: signal.Signals
) -> None:
    server = start(gpt2_tiny_dir, reliability_template, tmp_path, 60)  # a long drain
    stop_at: list[float] = []
    try:
        # 32 x 8 sequences of 480 tokens: the drain would take many seconds.
        clients = asyncio.ensure_future(load(server, stop_at, 120, ("long stream n=8",)))
        await until_busy(server, 128)
        server.process.send_signal(signal.SIGTERM)
        stop_at.append(time.monotonic())
        code, _ = await wait_exit(server, 0.5)
        if code is not None:
            pytest.fail(f"the drain ended before the second signal (exit {code}); more load?")
        server.process.send_signal(second)
        code, waited = await wait_exit(server, 30)
        outcomes = await asyncio.wait_for(clients, 60)
    finally:
        server.stop(signal.SIGKILL)
    results = collections.Counter(o.result for o in outcomes)
    report(
        f"second {second.name} during the drain",
        {"exit_code": code, "exit_seconds": round(waited, 2), "results": dict(results)},
    )
    assert code is not None and waited < SECOND_SIGNAL_EXIT, (
        f"{second.name} during the drain: exit {code} after {waited:.2f} s "
        f"(limit {SECOND_SIGNAL_EXIT} s)\n{server.output()[-3000:]}"
    )
    hung = [o.request for o in outcomes if o.result == "HANG"]
    assert not hung, f"{len(hung)} requests hung through the shutdown:\n" + "\n".join(hung[:10])
    assert results["complete"] < len(outcomes), f"the drain was not cut short: {results}"
