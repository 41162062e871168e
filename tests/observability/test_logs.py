"""One log pipeline: with --log-format json every line the server writes is JSON, uvicorn's
access and startup lines included, and each request's lines carry its request id."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from server_process import ServerProcess

from flowllm.cli import build_parser


def test_every_line_is_json_with_the_request_id(observed_server: ServerProcess) -> None:
    response = httpx.post(
        f"{observed_server.url}/v1/completions",
        json={"model": observed_server.model, "prompt": "Log me", "max_tokens": 2},
        headers={"x-request-id": "log-test-7"},
        timeout=60,
    )
    assert response.status_code == 200
    refused = httpx.post(
        f"{observed_server.url}/v1/completions", content=b"x", headers={"x-request-id": "bad-1"}
    )
    assert refused.status_code == 415
    time.sleep(0.5)  # the access line of the last response is written after it
    lines = [line for line in observed_server.output().splitlines() if line.strip()]
    events = [json.loads(line) for line in lines]  # raises on any line that is not JSON
    assert all({"event", "level", "timestamp"} <= event.keys() for event in events)
    loggers = {event.get("logger") for event in events}
    assert {"uvicorn.error", "uvicorn.access"} <= loggers
    access = [e for e in events if e.get("logger") == "uvicorn.access"]
    (ok,) = [e for e in access if e.get("request_id") == "log-test-7"]
    assert (ok["method"], ok["path"], ok["status"]) == ("POST", "/v1/completions", 200)
    (bad,) = [e for e in access if e.get("request_id") == "bad-1"]
    assert bad["status"] == 415
    assert all(e.get("request_id") for e in access)
    # --enable-log-requests: one line per graph request, naming the response it feeds.
    (received,) = [
        e for e in events
        if e["event"] == "request received" and e["response_id"] == "cmpl-log-test-7"
    ]  # fmt: skip
    assert received["params"]["max_tokens"] == 2
    assert received["request_id"].startswith("cmpl-")
    assert any(e["event"] == "flowllm serving" for e in events)


def test_request_logging_flags_follow_vllm() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).log_requests is False
    assert parser.parse_args(["serve", "--enable-log-requests"]).log_requests is True
    assert parser.parse_args(["serve", "--disable-log-requests"]).log_requests is False
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--enable-log-requests", "--disable-log-requests"])
