"""Stopping the server from outside: SIGINT (Ctrl-C) and SIGTERM both let a request in
flight finish, then exit 0 without a traceback."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import httpx
import pytest
from server_process import TINY_FLAGS, ServerProcess, wait_until

RUNNING = "flowllm:num_requests_running"
DRAIN_S = 60


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_drains_then_exits_cleanly(
    gpt2_tiny_dir: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    # The drain is the subject, not its speed: a busy machine may take more than the
    # tests' usual 5 s for 400 tokens.
    drain = ["--shutdown-timeout", str(DRAIN_S)]
    server = ServerProcess(str(gpt2_tiny_dir), [*TINY_FLAGS, *drain], log_dir=tmp_path)
    try:
        server.wait_healthy()
    except BaseException:
        server.stop()
        raise
    responses: list[httpx.Response] = []
    body = {"model": server.model, "prompt": "Once", "max_tokens": 400, "ignore_eos": True}

    def request() -> None:
        responses.append(
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=DRAIN_S + 15)
        )

    thread = threading.Thread(target=request)
    thread.start()
    try:
        assert wait_until(lambda: server.metrics()[RUNNING] == 1, timeout=10)
    finally:
        code = server.stop(sig, wait=DRAIN_S + 15)
        thread.join(timeout=DRAIN_S + 15)
    assert code == 0, server.output()
    assert "Traceback" not in server.output()
    assert responses and responses[0].status_code == 200  # drained, not cut off
    assert responses[0].json()["usage"]["completion_tokens"] == 400
