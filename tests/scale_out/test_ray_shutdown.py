"""SIGTERM to a Ray server: an idle one exits 0 within seconds, with Serve's HTTP proxy or
its direct ingress, and leaves no process behind; a stream in flight at the signal
finishes first, as on a single server (tests/e2e/test_e2e_shutdown.py)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from ray_helpers import STOP_BOUND_S, stop_within
from server_process import ServerProcess

DIRECT_INGRESS = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}
StartServer = Callable[..., ServerProcess]
# The drain period of the streaming test: the stream must end within it even on a loaded
# machine, where 400 tokens can take longer than the other tests' 5 s.
DRAIN_S = 60


@pytest.mark.parametrize("env", [{}, DIRECT_INGRESS], ids=["proxy", "direct_ingress"])
def test_an_idle_server_exits_promptly_leaving_nothing(
    start_own_cluster_server: StartServer, env: dict[str, str]
) -> None:
    code, took = stop_within(start_own_cluster_server(env), STOP_BOUND_S)
    assert code == 0, f"exit {code} after {took:.1f} s"


def test_a_stream_in_flight_finishes_before_the_exit(start_own_cluster_server: StartServer) -> None:
    proc = start_own_cluster_server({}, ("--shutdown-timeout", str(DRAIN_S)))
    # Done well within the server's --shutdown-timeout of the signal.
    body = {"prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}
    first = threading.Event()
    result: dict[str, Any] = {"finished": 0, "error": None, "done": False}

    def stream() -> None:
        try:
            with httpx.stream(
                "POST", f"{proc.url}/v1/completions", json=body, timeout=120
            ) as response:
                result["status"] = response.status_code
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        result["done"] = True
                    elif line.startswith("data: "):
                        event = json.loads(line[len("data: ") :])
                        first.set()
                        if "error" in event:
                            result["error"] = event["error"]
                        elif event["choices"][0]["finish_reason"] == "length":
                            result["finished"] += 1
        except httpx.HTTPError as exc:
            result["error"] = repr(exc)
        finally:
            first.set()

    client = threading.Thread(target=stream)
    client.start()
    try:
        assert first.wait(60)
        assert result["error"] is None and not result["done"], result  # still running
        # The drain waits for the stream (at most --shutdown-timeout) on top.
        code, took = stop_within(proc, STOP_BOUND_S + DRAIN_S)
    finally:
        client.join(60)
    assert code == 0, f"exit {code} after {took:.1f} s"
    assert result["status"] == 200 and result["error"] is None, result
    assert result["finished"] == 1 and result["done"], result  # to its end, not cut
