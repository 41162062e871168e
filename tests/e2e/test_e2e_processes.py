"""The default graph's processes against a real server: `--api-server-count 2` serves the
API from two fronts sharing the port and one engine core; killing the core answers every
request in flight with an error within 2 s, makes `/health` 503 and brings a new core;
killing a front leaves the other serving; past the restart intensity the server exits 70.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2e_helpers import start_server
from server_process import DEFAULT_GRAPH, TINY_FLAGS, ServerProcess, process_tree, wait_until

PROMPTS = ["Hello there", "The quick brown fox", "Once upon a time", "In the beginning"]


def complete(url: str, prompt: str, max_tokens: int = 8) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        timeout=60,
    )


def access_lines(server: ServerProcess) -> list[str]:
    """The access log's completion lines, each naming the front that answered."""
    return [
        line
        for line in server.output().splitlines()
        if "POST /v1/completions" in line and '"front": ' in line
    ]


def line_front(line: str) -> str:
    return line.split('"front": ')[1].split(",")[0]


def fronts_served(server: ServerProcess) -> set[str]:
    return {line_front(line) for line in access_lines(server)}


def healthy(server: ServerProcess) -> bool:
    """/health answers 200; a probe that times out (queued for a front still starting, on
    a busy machine) is a no."""
    try:
        return httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def two_fronts(gpt2_tiny_dir: Path) -> Iterator[ServerProcess]:
    # At info level each front logs its access lines, which name the front.
    flags = [*TINY_FLAGS, "--api-server-count", "2", "--log-level", "info"]
    proc = start_server(str(gpt2_tiny_dir), flags)
    try:
        yield proc
    finally:
        proc.stop()


def test_two_fronts_share_the_port_and_one_core(
    two_fronts: ServerProcess, server: ServerProcess
) -> None:
    assert len(two_fronts.processes_named("flowllm-front")) == 2
    assert len(two_fronts.processes_named("flowllm-core")) == 1
    expected = {p: complete(server.url, p).json()["choices"][0]["text"] for p in PROMPTS}
    client = two_fronts.client()
    results: dict[str, str] = {}

    def ask(prompt: str) -> None:
        for _ in range(4):  # new connections: the kernel spreads them over both fronts
            out = client.completions.create(
                model=two_fronts.model, prompt=prompt, max_tokens=8, temperature=0
            )
            assert results.setdefault(prompt, out.choices[0].text) == out.choices[0].text

    threads = [threading.Thread(target=ask, args=(p,)) for p in PROMPTS * 2]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == expected  # the same greedy text as one process serves

    def both_served() -> bool:
        """Whether each front has answered a completion (each call asks one more: on a
        busy machine one front may win every accept of a burst)."""
        if fronts_served(two_fronts) == {"0", "1"}:
            return True
        assert (
            complete(two_fronts.url, PROMPTS[0]).json()["choices"][0]["text"]
            == expected[PROMPTS[0]]
        )
        return False

    assert wait_until(both_served, timeout=60)


def test_every_front_reports_every_fronts_requests(two_fronts: ServerProcess) -> None:
    """A scrape reaches one front; its /metrics sums every front's series (and the
    core's), so a counter does not depend on which front answered."""
    count = "flowllm:e2e_request_latency_seconds_count"
    before = two_fronts.metrics()[count]
    seen = len(access_lines(two_fronts))
    sent = 0
    while sent < 4 or {line_front(line) for line in access_lines(two_fronts)[seen:]} != {"0", "1"}:
        assert sent < 200, "one front took every connection"
        assert complete(two_fronts.url, "Hello there").status_code == 200
        sent += 1
    scrapes = [two_fronts.metrics()[count] for _ in range(8)]  # new connections each
    assert scrapes == [before + sent] * 8


def test_killing_a_front_leaves_the_other_serving(two_fronts: ServerProcess) -> None:
    victim = two_fronts.processes_named("flowllm-front")[0]
    os.kill(victim, signal.SIGKILL)
    answered = [complete(two_fronts.url, "Hello there").status_code for _ in range(10)]
    assert answered == [200] * 10  # the survivor took every connection
    assert wait_until(lambda: len(two_fronts.processes_named("flowllm-front")) == 2, timeout=60)
    assert victim not in two_fronts.processes_named("flowllm-front")
    assert "a front exited; starting it again" in two_fronts.output()
    # Every request of the dead front had finished: the core held nothing to abort for it.
    aborted = re.findall(r'"aborted": (\d+), "event": "front disconnected"', two_fronts.output())
    assert aborted == ["0"], aborted
    assert complete(two_fronts.url, "Hello there").status_code == 200


def test_killing_the_core_answers_in_flight_requests_and_a_new_core_serves(
    gpt2_tiny_dir: Path,
) -> None:
    lone_front = ["--api-server-count", "1"]
    server = start_server(str(gpt2_tiny_dir), [*TINY_FLAGS, *lone_front, "--log-level", "info"])
    try:
        # A lone front's finished requests are forgotten by the core: killed, it leaves
        # nothing to abort there, and its replacement serves.
        assert complete(server.url, "Hello there").status_code == 200
        (front,) = server.processes_named("flowllm-front")
        os.kill(front, signal.SIGKILL)
        assert wait_until(lambda: "front disconnected" in server.output(), 30)
        aborted = re.findall(r'"aborted": (\d+), "event": "front disconnected"', server.output())
        assert aborted == ["0"], aborted
        assert wait_until(lambda: healthy(server), 60)
        (core,) = server.processes_named("flowllm-core")
        answers: list[tuple[float, httpx.Response | BaseException]] = []

        def long_request() -> None:
            try:
                response = complete(server.url, "Once upon a time", max_tokens=400)
            except httpx.HTTPError as exc:
                answers.append((time.monotonic(), exc))
            else:
                answers.append((time.monotonic(), response))

        flight = [threading.Thread(target=long_request) for _ in range(4)]
        for thread in flight:
            thread.start()
        assert wait_until(lambda: server.metrics().get("flowllm:num_requests_running", 0) >= 1, 10)
        killed = time.monotonic()
        os.kill(core, signal.SIGKILL)
        for thread in flight:
            thread.join(30)
        assert len(answers) == 4
        for answered, response in answers:
            assert answered - killed < 2.0, "an in-flight request waited past 2 s"
            assert isinstance(response, httpx.Response), response
            assert response.status_code == 503, response.text
            assert "engine core" in response.json()["error"]["message"]
        assert httpx.get(f"{server.url}/health").status_code == 503
        assert wait_until(lambda: healthy(server), 60)
        (new_core,) = server.processes_named("flowllm-core")
        assert new_core != core
        assert complete(server.url, "Hello there").status_code == 200
        assert "the engine core exited; starting it again" in server.output()
    finally:
        server.stop()


def test_a_core_failing_past_its_restart_intensity_exits_70(
    gpt2_tiny_dir: Path, tmp_path: Path
) -> None:
    graph = tmp_path / "one-restart.yaml"
    graph.write_text(
        DEFAULT_GRAPH.read_text().replace(
            "supervision: {on_error: restart, group: step_loop,",
            "supervision: {on_error: restart, group: step_loop, max_restarts: 1,",
        )
    )
    server = start_server(str(gpt2_tiny_dir), TINY_FLAGS, graph=graph)
    try:
        (first,) = server.processes_named("flowllm-core")
        os.kill(first, signal.SIGKILL)  # restarted: one restart is allowed
        assert wait_until(lambda: server.processes_named("flowllm-core") not in ([], [first]), 60)
        (second,) = server.processes_named("flowllm-core")
        os.kill(second, signal.SIGKILL)  # past the intensity: the server escalates
        assert wait_until(lambda: server.process.poll() is not None, 30), server.output()
        assert server.process.returncode == 70, server.output()
        assert "failed past its restart intensity" in server.output()
        assert not [p for p in process_tree(server.process.pid) if p != server.process.pid]
    finally:
        server.stop()
