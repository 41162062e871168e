"""The shipped Grafana dashboard against a real Prometheus (Debian's `prometheus`).

Prometheus scrapes a running server every second while it serves a load; then every
PromQL query of every panel, with Grafana's variables filled in, must return data.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_process import REPO, ServerProcess, free_port

DASHBOARD = REPO / "examples" / "grafana" / "flowllm-dashboard.json"
LOAD_S = 8.0
RATE_INTERVAL = "30s"  # what Grafana's $__rate_interval stands for in these queries

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="needs Debian's prometheus package (`make setup` installs it)",
)


def prometheus_get(url: str, path: str, **params: str) -> Any:
    response = httpx.get(f"{url}{path}", params=params, timeout=10)
    response.raise_for_status()
    body = response.json()
    assert body["status"] == "success", body
    return body["data"]


@pytest.fixture
def prometheus(observed_server: ServerProcess, tmp_path: Path) -> Iterator[str]:
    target = observed_server.url.removeprefix("http://")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - {{job_name: flowllm, static_configs: [{{targets: ['{target}']}}]}}\n"
    )
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:  # up once it has scraped the server at least once
            try:
                result = prometheus_get(url, "/api/v1/query", query="up")["result"]
                if result and result[0]["value"][1] == "1":
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or process.poll() is not None:
                raise AssertionError((tmp_path / "prometheus.log").read_text()[-3000:])
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)
        log.close()


def load(server: ServerProcess, seconds: float, concurrency: int = 4) -> int:
    """Streamed completions from `concurrency` clients for `seconds`; how many finished."""
    done = [0] * concurrency
    deadline = time.monotonic() + seconds

    def client(i: int) -> None:
        with httpx.Client(timeout=60) as http:
            while time.monotonic() < deadline:
                body = {"model": server.model, "prompt": f"Load {i} {done[i]}",
                        "max_tokens": 8 + 4 * i, "stream": True}  # fmt: skip
                with http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    for _ in r.iter_lines():
                        pass
                done[i] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(done)


def panel_queries(dashboard: dict[str, Any], model: str) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target, with the dashboard's variables filled in."""
    variables = {"$model_name": model, "$__rate_interval": RATE_INTERVAL}
    queries = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for name, value in variables.items():
                expr = expr.replace(name, value)
            assert "$" not in expr, f"unfilled variable in {panel['title']!r}: {expr}"
            queries.append((panel["title"], expr))
    return queries


def test_every_panel_of_the_dashboard_returns_data(
    observed_server: ServerProcess, prometheus: str
) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert load(observed_server, LOAD_S) > 0
    time.sleep(2.5)  # two more scrapes after the load
    model_names = prometheus_get(prometheus, "/api/v1/label/model_name/values")
    assert model_names == [observed_server.model]  # the dashboard's $model_name choices
    empty = []
    for title, expr in panel_queries(dashboard, observed_server.model):
        result = prometheus_get(prometheus, "/api/v1/query", query=expr)["result"]
        values = [float(series["value"][1]) for series in result]
        if not any(value == value for value in values):  # every value NaN, or none at all
            empty.append(f"{title}: {expr}")
    assert not empty, "panels without data:\n" + "\n".join(empty)
    # A few values that must be right, not merely present.
    stages = prometheus_get(
        prometheus,
        "/api/v1/query",
        query=f"sum by (stage) (rate(flowllm:stage_duration_seconds_sum[{RATE_INTERVAL}]))",
    )["result"]
    assert {s["metric"]["stage"] for s in stages} >= {"execute", "schedule", "deliver"}
    finished = prometheus_get(
        prometheus, "/api/v1/query", query="sum(vllm:request_success_total)"
    )["result"]
    flowllm_finished = prometheus_get(
        prometheus, "/api/v1/query", query="sum(flowllm:request_success_total)"
    )["result"]
    assert float(finished[0]["value"][1]) == float(flowllm_finished[0]["value"][1]) > 0
