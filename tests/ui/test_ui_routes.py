"""The page's routes over HTTP: what is public, what needs the key, the live feed's
numbers and bound, the request timelines, and --disable-ui."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import API_KEY, start_server
from server_process import TINY_FLAGS, ServerProcess

from flowllm.ui.live import INTERVAL_S, MAX_SUBSCRIBERS, quantile

MESSAGES = [{"role": "user", "content": "Hello"}]
STAGES = [
    "ingest",
    "validate",
    "tokenize",
    "schedule",
    "execute",
    "guide",
    "sample",
    "detokenize",
    "deliver",
]


def feed_events(url: str, count: int, headers: dict[str, str] | None = None) -> list[Any]:
    """The first `count` snapshots of the live feed."""
    events = []
    with httpx.stream("GET", f"{url}/ui/feed", headers=headers, timeout=30) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
                if len(events) == count:
                    break
    return events


def test_quantile_interpolates_within_the_bucket() -> None:
    bounds = (1.0, 2.0, 4.0)
    # 10 observations in (1, 2], 10 in (2, 4]: the median is the top of the first bucket.
    assert quantile(bounds, [0, 10, 10, 0], 0.5) == pytest.approx(2.0)
    assert quantile(bounds, [0, 10, 10, 0], 0.75) == pytest.approx(3.0)
    assert quantile(bounds, [4, 0, 0, 0], 0.5) == pytest.approx(0.5)
    assert quantile(bounds, [0, 0, 0, 3], 0.5) == 4.0  # only +Inf: its lower bound
    assert quantile(bounds, [0, 0, 0, 0], 0.5) is None


def test_page_and_static_files_are_public_the_data_is_not(ui_auth_server: ServerProcess) -> None:
    url = ui_auth_server.url
    page = httpx.get(f"{url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for name, media in (("ui.js", "text/javascript"), ("ui.css", "text/css")):
        r = httpx.get(f"{url}/ui/static/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(media)
    assert httpx.get(f"{url}/ui/auth").json() == {"api_key_required": True}
    missing = httpx.get(f"{url}/ui/static/..%2Fapp.py")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
    good = {"Authorization": f"Bearer {API_KEY}"}
    for path in ("/ui/graph", "/ui/feed", "/ui/timeline", "/ui/timeline/x"):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.get(url + path, headers=headers)
            assert r.status_code == 401, path
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/ui/graph", headers=good).status_code == 200
    assert feed_events(url, 1, good)[0]["stages"]


def test_graph_shape_is_the_yaml(ui_server: ServerProcess) -> None:
    shape = httpx.get(f"{ui_server.url}/ui/graph").json()
    assert shape["name"] == "default" and shape["source"] == "default.yaml"
    assert [s["name"] for s in shape["stages"]] == STAGES
    edges = {(e["from"], e["port"], e["to"], e["in"], e["capacity"]) for e in shape["edges"]}
    assert ("schedule", "out", "execute", "in", 2) in edges
    assert ("sample", "out", "schedule", "step_results", 2) in edges  # the step loop
    assert ("tokenize", "errors", "deliver", "errors", 64) in edges  # fan-in
    assert ("schedule", "guide", "guide", "in", 2) in edges  # beside execute
    assert ("guide", "out", "sample", "masks", 2) in edges  # joined in sample
    assert ("schedule", "choices", "detokenize", "choices", 64) in edges  # beside the loop
    assert len(edges) == 15


def test_feed_numbers_follow_the_work(ui_server: ServerProcess) -> None:
    """Rates, busy time and p50 over the last interval; counts against the requests sent."""
    client = ui_server.client()
    before = feed_events(ui_server.url, 1)[0]
    done = threading.Event()
    results: list[Any] = []

    def load() -> None:
        while not done.is_set():
            results.append(
                client.completions.create(
                    model=ui_server.model,
                    prompt="Count:",
                    max_tokens=24,
                    extra_body={"ignore_eos": True},
                )
            )

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        events = feed_events(ui_server.url, 4)
    finally:
        done.set()
        for t in threads:
            t.join()
    busy = [e for e in events[1:] if e["stages"]["execute"]["rate"]]
    assert busy, events
    last = busy[-1]
    execute = last["stages"]["execute"]
    assert 0 < execute["busy"] <= 1 and execute["p50_s"] > 0
    assert last["engine"]["tokens_per_s"] > 0
    assert last["stages"]["validate"]["messages"] > before["stages"]["validate"]["messages"]
    time.sleep(INTERVAL_S)  # past the snapshot the last subscriber shared
    after = feed_events(ui_server.url, 1)[0]
    # Every request sent went through validate once and deliver delivered its tokens.
    sent = len(results)
    validated = after["stages"]["validate"]["messages"] - before["stages"]["validate"]["messages"]
    assert validated == sent
    assert after["engine"]["generated_tokens"] - before["engine"]["generated_tokens"] == 24 * sent
    assert after["engine"]["running"] == 0 and after["engine"]["waiting"] == 0
    for channel in after["channels"].values():
        assert 0 <= channel["depth"] <= channel["capacity"]


def test_feed_connections_are_bounded(ui_server: ServerProcess) -> None:
    url = ui_server.url
    with httpx.Client(timeout=30) as client:
        streams = [client.stream("GET", f"{url}/ui/feed") for _ in range(MAX_SUBSCRIBERS)]
        opened = [s.__enter__() for s in streams]
        # Kept: a dropped line iterator closes its connection.
        lines = [response.iter_lines() for response in opened]
        try:
            for response, line in zip(opened, lines, strict=True):
                assert response.status_code == 200
                assert next(line).startswith("data: ")  # its first snapshot: the slot is held
            refused = httpx.get(f"{url}/ui/feed", timeout=10)
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "5"
            error = refused.json()["error"]
            assert error["code"] == "too_many_live_views" and error["type"] == "RateLimitError"
            # The API itself is not affected.
            assert httpx.get(f"{url}/v1/models").status_code == 200
        finally:
            for s in streams:
                s.__exit__(None, None, None)
    # Closed connections give their slots back.
    assert feed_events(url, 1)[0]["subscribers"] >= 1


def test_timeline_of_a_request_run_while_watched(ui_server: ServerProcess) -> None:
    url = ui_server.url
    client = ui_server.client()
    with httpx.stream("GET", f"{url}/ui/feed", timeout=30) as feed:
        line = feed.iter_lines()  # kept: dropping it would close the connection
        assert next(line).startswith("data: ")  # subscribed: spans are kept from now on
        answer = client.chat.completions.create(
            model=ui_server.model, messages=MESSAGES, max_tokens=6, temperature=0
        )
        timeline = httpx.get(f"{url}/ui/timeline/{answer.id}").json()
    assert answer.id in httpx.get(f"{url}/ui/timeline").json()["requests"]
    spans = [e for e in timeline["traceEvents"] if e["ph"] == "X"]
    stages = {e["cat"] for e in spans}
    assert set(STAGES) - {"ingest", "guide"} <= stages  # guide: no constrained request
    # One execute step per generated token (the first also prefills), all about this request.
    assert sum(e["cat"] == "execute" for e in spans) == answer.usage.completion_tokens
    assert all(e["args"]["request_ids"] == [answer.id] for e in spans)
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in spans)
    tracks = {e["args"]["name"] for e in timeline["traceEvents"] if e["name"] == "thread_name"}
    assert "execute" in tracks
    # Unwatched, a request leaves no spans; unknown and oversized ids are clear errors.
    unwatched = client.chat.completions.create(
        model=ui_server.model, messages=MESSAGES, max_tokens=2
    )
    r = httpx.get(f"{url}/ui/timeline/{unwatched.id}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "timeline_not_found"
    r = httpx.get(f"{url}/ui/timeline/{'x' * 300}")
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"


@pytest.fixture(scope="module")
def no_ui_server(gpt2_tiny_dir: Path) -> Iterator[ServerProcess]:
    proc = start_server(str(gpt2_tiny_dir), [*TINY_FLAGS, "--disable-ui"])
    try:
        yield proc
    finally:
        proc.stop()


def test_disable_ui_turns_the_page_off(no_ui_server: ServerProcess) -> None:
    for path in ("/", "/ui/static/ui.js", "/ui/auth", "/ui/graph", "/ui/feed"):
        r = httpx.get(no_ui_server.url + path)
        assert r.status_code == 404, path
        assert r.json()["error"]["type"] == "NotFoundError"
    assert httpx.get(f"{no_ui_server.url}/v1/models").status_code == 200


def raw_get(server: ServerProcess, target: str) -> int:
    """The status of a GET whose request target is sent exactly as given (no client
    normalises its dots)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        head = sock.recv(64).decode("latin-1")
    return int(head.split()[1])


def test_public_prefixes_do_not_reach_keyed_routes(ui_auth_server: ServerProcess) -> None:
    for target in (
        "/ui/static/../graph",
        "/ui/static/%2e%2e/graph",
        "/ui/static/..%2fgraph",
        "/ui/static/../../v1/models",
        "/ui/static/ui.js/../../feed",
    ):
        assert raw_get(ui_auth_server, target) in (401, 404), target


def test_an_open_page_does_not_hold_up_shutdown(gpt2_tiny_dir: Path) -> None:
    """SIGTERM with a live feed open: the feed ends with the graph and the server exits 0."""
    server = start_server(str(gpt2_tiny_dir), list(TINY_FLAGS))
    try:
        with httpx.stream("GET", f"{server.url}/ui/feed", timeout=30) as feed:
            lines = feed.iter_lines()
            assert next(lines).startswith("data: ")
            started = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            for _ in lines:  # ends when the server closes the stream
                pass
            # The feed ends within a snapshot interval of the graph's end, well before
            # uvicorn's own deadline for connections (shutdown timeout + 2 s).
            assert time.monotonic() - started < 5.0
        assert server.process.wait(timeout=30) == 0
    finally:
        server.stop()
