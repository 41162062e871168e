"""Supervision against a real server: a stage's bug on one request answers that request
with a 500 and the server goes on serving; a stage stuck on one request makes `/health`
answer 503 until it is idle; past the restart intensity the process answers what is in
flight and exits with status 70, for its process manager to restart it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
from e2e_helpers import assert_error, start_server
from server_process import DEFAULT_GRAPH, TINY_FLAGS

HERE = Path(__file__).resolve().parent


def boom_graph(path: Path, max_restarts: int, timeout_s: float = 60) -> Path:
    """The default graph with tokenize replaced by the one that fails on BOOM and hangs
    on HANG."""
    text = DEFAULT_GRAPH.read_text()
    stage = f"{HERE / 'boom_stage.py'}:BoomTokenize"
    text = text.replace("flowllm.stages.tokenize:Tokenize", stage)
    text = text.replace(
        "supervision: {on_error: fail_request, timeout_s: 60}",
        f"supervision: {{on_error: fail_request, max_restarts: {max_restarts}, "
        f"timeout_s: {timeout_s}}}",
    )
    path.write_text(text)
    return path


def complete(url: str, prompt: str) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 4, "temperature": 0},
        timeout=30,
    )


def test_a_bug_on_one_request_fails_that_request_only(gpt2_tiny_dir: Path, tmp_path: Path) -> None:
    server = start_server(
        str(gpt2_tiny_dir), TINY_FLAGS, graph=boom_graph(tmp_path / "boom.yaml", 5)
    )
    try:
        before = complete(server.url, "Hello there")
        assert before.status_code == 200
        failed = complete(server.url, "Hello BOOM")
        error = assert_error(failed, 500)
        assert error["type"] == "InternalServerError" and "tokenize" in error["message"]
        assert httpx.get(f"{server.url}/health").status_code == 200
        after = complete(server.url, "Hello there")
        assert after.status_code == 200
        assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'flowllm:stage_errors_total{stage="tokenize"} 1.0' in metrics
        assert server.process.poll() is None
    finally:
        server.stop()


def test_failures_past_the_intensity_exit_70(gpt2_tiny_dir: Path, tmp_path: Path) -> None:
    server = start_server(
        str(gpt2_tiny_dir), TINY_FLAGS, graph=boom_graph(tmp_path / "boom.yaml", 1)
    )
    try:
        assert_error(complete(server.url, "BOOM one"), 500)  # tolerated
        try:
            second = complete(server.url, "BOOM two")  # escalates
        except httpx.HTTPError:
            pass  # the server may close the connection as it exits
        else:
            assert second.status_code in (500, 503), second.text
        deadline = time.monotonic() + 15
        while server.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.process.returncode == 70, server.output()
        assert "the engine failed; exiting" in server.output()
    finally:
        server.stop()


def test_a_stuck_stage_makes_health_503_until_it_is_idle(
    gpt2_tiny_dir: Path, tmp_path: Path
) -> None:
    server = start_server(
        str(gpt2_tiny_dir), TINY_FLAGS, graph=boom_graph(tmp_path / "hang.yaml", 5, 0.5)
    )
    try:
        assert httpx.get(f"{server.url}/health").status_code == 200
        answers: list[httpx.Response] = []
        stuck = threading.Thread(target=lambda: answers.append(complete(server.url, "HANG")))
        stuck.start()
        statuses = []
        while stuck.is_alive():
            health = httpx.get(f"{server.url}/health", timeout=5)
            statuses.append(health.status_code)
            if health.status_code == 503:
                assert health.json()["error"]["code"] == "engine_unhealthy"
            time.sleep(0.1)
        stuck.join()
        assert 503 in statuses, statuses
        assert answers[0].status_code == 500, answers[0].text
        deadline = time.monotonic() + 5
        while httpx.get(f"{server.url}/health").status_code != 200:
            assert time.monotonic() < deadline, "still unhealthy once the stage is idle"
            time.sleep(0.1)
        assert complete(server.url, "Hello there").status_code == 200
    finally:
        server.stop()
