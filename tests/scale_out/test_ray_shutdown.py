"""SIGTERM to a Ray server: an idle one on a cluster of its own exits 0 within seconds
and leaves no process behind (Serve's direct ingress; its HTTP proxy exits the same way in
the last test); a stream in flight at the signal finishes first, and one that outlasts
--shutdown-timeout ends with a 503 event, as on a single server
(tests/e2e/test_e2e_shutdown.py). The stream tests run on the session's cluster."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import httpx
from ray_helpers import STOP_BOUND_S, stop_within
from server_process import ServerProcess

DIRECT_INGRESS = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}
StartServer = Callable[..., ServerProcess]
# The drain period of the streaming test: the stream must end within it even on a loaded
# machine, where 400 tokens can take longer than the other tests' 5 s.
DRAIN_S = 60


def test_an_idle_server_exits_promptly_leaving_nothing(
    start_own_cluster_server: StartServer,
) -> None:
    code, took = stop_within(start_own_cluster_server(DIRECT_INGRESS), STOP_BOUND_S)
    assert code == 0, f"exit {code} after {took:.1f} s"


def stream_then_stop(proc: ServerProcess, bound: float) -> tuple[int | None, dict[str, Any]]:
    """Start a 400-token stream, SIGTERM the server at its first event; the exit code and
    what the stream got."""
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
            result["cut"] = repr(exc)
        finally:
            first.set()

    client = threading.Thread(target=stream)
    client.start()
    try:
        assert first.wait(60)
        assert result["error"] is None and not result["done"], result  # still running
        code, took = stop_within(proc, bound)
    finally:
        client.join(60)
    result["took"] = took
    return code, result


def test_a_stream_in_flight_finishes_before_the_exit(
    start_shared_cluster_server: StartServer,
) -> None:
    proc = start_shared_cluster_server(("--shutdown-timeout", str(DRAIN_S)))
    # The drain waits for the stream (at most --shutdown-timeout) on top.
    code, result = stream_then_stop(proc, STOP_BOUND_S + DRAIN_S)
    assert code == 0, f"exit {code} after {result['took']:.1f} s"
    assert result["status"] == 200 and result["error"] is None and "cut" not in result, result
    assert result["finished"] == 1 and result["done"], result  # to its end, not cut


def test_a_stream_outlasting_the_drain_ends_with_an_error_event(
    start_shared_cluster_server: StartServer,
) -> None:
    """The drain period over, a stream still running gets the 503 a single server sends
    (an error event), not a cut connection."""
    proc = start_shared_cluster_server(("--shutdown-timeout", "0"))
    code, result = stream_then_stop(proc, STOP_BOUND_S)
    assert code == 0, f"exit {code} after {result['took']:.1f} s"
    assert result["status"] == 200 and "cut" not in result, result
    assert result["error"] is not None, result
    assert result["error"]["type"] == "ServiceUnavailableError", result
    assert result["finished"] == 0, result
