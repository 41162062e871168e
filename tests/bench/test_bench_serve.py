"""`flowllm bench serve` end to end against a real HTTP server on 127.0.0.1.

The server (tests/bench/conftest.py) streams with known delays and token counts, so the
command's counts, token totals and latencies are checked against what it was sent; its
failures (HTTP 500, error events, a request that never ends, a strict schema) check that
errors are counted and summarised and that the run always ends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from bench_fake_server import FakeOpenAIServer

from flowllm.bench.serve import arrival_offsets, read_result_file
from flowllm.cli import main

StartServer = Callable[..., FakeOpenAIServer]
REPO = Path(__file__).resolve().parents[2]


def bench(
    server: FakeOpenAIServer | str,
    tmp_path: Path,
    *extra: str,
    n: int = 8,
    inp: int = 12,
    out: int = 5,
) -> tuple[int, dict[str, Any]]:
    """Run the command in-process; its exit status and the result file as JSON."""
    url = server if isinstance(server, str) else server.base_url
    result = tmp_path / "result.json"
    argv = ["bench", "serve", "--base-url", url, "--num-prompts", str(n)]
    argv += ["--random-input-len", str(inp), "--random-output-len", str(out)]
    argv += ["--result-file", str(result), "--disable-tqdm", *extra]
    status = main(argv)
    return status, json.loads(result.read_text())


def test_counts_tokens_latencies_and_the_request_bodies(
    start_server: StartServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = start_server(ttft_s=0.15, itl_s=0.02)
    extra = ["--max-concurrency", "3", "--api-key", "secret-key", "--model", "m1"]
    status, result = bench(server, tmp_path, *extra, "--extra-body", '{"temperature": 0}')
    assert status == 0

    m = result["metrics"]
    assert (m["completed"], m["failed"]) == (8, 0)
    assert m["total_input_tokens"] == 8 * 12  # the server counts the prompt's words
    assert m["total_output_tokens"] == 8 * 5
    # TTFT: the server waits 0.15 s after an empty first event; the bound above is loose
    # because the machine is shared.
    assert m["ttft"]["min_ms"] >= 150.0 and m["ttft"]["max_ms"] < 150.0 + 1000.0
    assert m["itl"]["count"] == 8 * 4
    # Gaps are 20 ms at the server; a late read can bunch two events, so bounds are loose.
    assert m["itl"]["median_ms"] >= 10.0
    assert 15.0 <= m["tpot"]["mean_ms"] < 20.0 + 300.0
    assert m["e2el"]["min_ms"] >= 150.0 + 4 * 20.0 - 5.0
    assert m["request_throughput"] == pytest.approx(8 / m["duration_s"])
    assert m["peak_concurrency"] <= 3 and server.max_inflight <= 3
    assert m["errors"] == {}

    records = result["requests"]
    assert [r["index"] for r in records] == list(range(8))
    for r in records:
        assert r["success"] and r["error"] is None
        assert r["prompt_tokens_from_server"] and r["output_tokens_from_server"]
        assert r["generated_text"] == " w0 w1 w2 w3 w4"
        assert r["ttft_s"] >= 0.15 and len(r["itl_s"]) == 4
        assert r["latency_s"] == pytest.approx(r["ttft_s"] + sum(r["itl_s"]), abs=0.05)

    assert result["model"] == "m1"
    assert result["url"] == server.base_url + "/v1/completions"
    assert result["config"]["api_key"] == "***"  # the key never lands in the file
    assert result["config"]["max_concurrency"] == 3
    assert result["config"]["request_rate"] == "inf"

    assert len(server.requests) == 8
    for req in server.requests:
        body = req["body"]
        assert req["path"] == "/v1/completions"
        assert req["headers"]["authorization"] == "Bearer secret-key"
        assert body["model"] == "m1" and body["stream"] is True
        assert body["max_tokens"] == 5 and body["ignore_eos"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["temperature"] == 0
        assert len(body["prompt"].split()) == 12

    stdout = capsys.readouterr().out
    assert "Serving Benchmark Result" in stdout
    assert "Successful requests:                     8" in stdout
    assert "Total generated tokens:                  40" in stdout
    assert "Mean TTFT (ms):" in stdout and "P99 E2EL (ms):" in stdout


def test_failures_are_counted_and_summarised(
    start_server: StartServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Requests 3, 6, 9, 12 get HTTP 500; 4 and 8 an error event after their first token.
    server = start_server(ttft_s=0.01, itl_s=0.005, fail_every=3, error_event_every=4)
    status, result = bench(server, tmp_path, "--model", "m", "--max-concurrency", "1", n=12)
    assert status == 0
    m = result["metrics"]
    assert (m["completed"], m["failed"]) == (6, 6)
    assert m["errors"] == {
        "HTTP 500: simulated overload": 4,
        "error event: simulated engine fault": 2,
    }
    assert m["total_output_tokens"] == 6 * 5  # only successful requests count
    assert m["total_input_tokens"] == 6 * 12
    # With one request at a time, arrival order is prompt order.
    failed = [r["index"] for r in result["requests"] if not r["success"]]
    assert failed == [2, 3, 5, 7, 8, 11]
    out = capsys.readouterr().out
    assert "Failed requests:                         6" in out
    assert "4 x HTTP 500: simulated overload" in out


def test_a_hung_request_times_out_and_the_run_ends(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(ttft_s=0.01, itl_s=0.005, hang_every=2)
    begin = time.monotonic()
    status, result = bench(server, tmp_path, "--model", "m", "--request-timeout", "0.6", n=4)
    assert time.monotonic() - begin < 10.0
    assert status == 0
    m = result["metrics"]
    assert (m["completed"], m["failed"]) == (2, 2)
    assert m["errors"] == {"timeout: no complete response within 0.6 s": 2}
    for r in result["requests"]:
        if not r["success"]:
            assert 0.6 <= r["latency_s"] < 0.6 + 1.0
            assert r["ttft_s"] is not None  # its first token did arrive


def test_unreachable_server_fails_every_request_with_exit_status_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A port that was free a moment ago: connections are refused at once.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    status, result = bench(f"http://127.0.0.1:{port}", tmp_path, "--model", "m", n=3)
    assert status == 1
    assert result["metrics"]["completed"] == 0 and result["metrics"]["failed"] == 3
    assert all(e.startswith("ConnectError") for e in result["metrics"]["errors"])
    assert "ConnectError" in capsys.readouterr().out


def test_chat_endpoint_without_ignore_eos_on_a_strict_server(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(ttft_s=0.05, itl_s=0.005, strict=True)
    # With ignore_eos the strict server refuses every request (as transformers serve does).
    status, refused = bench(server, tmp_path, "--endpoint", "chat", "--model", "m", n=2)
    assert status == 1 and refused["metrics"]["failed"] == 2
    assert "HTTP 422" in next(iter(refused["metrics"]["errors"]))

    server.requests.clear()
    status, result = bench(
        server, tmp_path, "--endpoint", "chat", "--no-ignore-eos", "--model", "m", n=4, out=6
    )
    assert status == 0
    m = result["metrics"]
    assert (m["completed"], m["total_output_tokens"]) == (4, 24)
    assert m["ttft"]["min_ms"] >= 50.0  # the empty role event does not count as a token
    assert result["url"].endswith("/v1/chat/completions")
    for req in server.requests:
        body = req["body"]
        assert "ignore_eos" not in body
        assert body["max_completion_tokens"] == 6
        assert body["messages"][0]["role"] == "user"


def test_model_from_the_server_and_a_base_url_ending_in_v1(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(ttft_s=0.01, itl_s=0.001, model_id="served-name")
    status, result = bench(server.base_url + "/v1/", tmp_path, n=2)
    assert status == 0 and result["model"] == "served-name"
    assert all(req["body"]["model"] == "served-name" for req in server.requests)
    assert all(req["path"] == "/v1/completions" for req in server.requests)


def test_request_rate_spreads_the_sends_on_the_seeded_schedule(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(ttft_s=0.01, itl_s=0.001)
    args = ["--model", "m", "--request-rate", "20", "--seed", "11"]
    status, result = bench(server, tmp_path, *args, n=10, out=2)
    assert status == 0
    expected = arrival_offsets(10, 20.0, 1.0, seed=11)
    starts = [r["start_s"] for r in result["requests"]]
    for got, due in zip(starts, expected, strict=True):
        assert due - 0.005 <= got < due + 0.5  # never early; late only by scheduling noise
    assert result["config"]["request_rate"] == 20.0


def test_without_usage_tokens_are_counted_with_the_tokenizer(
    start_server: StartServer, tmp_path: Path, gpt2_tokenizer_dir: Path, gpt2_tokenizer
) -> None:
    server = start_server(ttft_s=0.01, itl_s=0.001, send_usage=False)
    args = ["--model", "m", "--tokenizer", str(gpt2_tokenizer_dir)]
    status, result = bench(server, tmp_path, *args, n=3, inp=40, out=4)
    assert status == 0
    for r in result["requests"]:
        assert not r["prompt_tokens_from_server"] and not r["output_tokens_from_server"]
        assert r["output_tokens"] == len(gpt2_tokenizer.encode(r["generated_text"]))
    for req in server.requests:
        assert abs(len(gpt2_tokenizer.encode(req["body"]["prompt"])) - 40) <= 2
    m = result["metrics"]
    assert m["total_input_tokens"] == sum(r["prompt_tokens"] for r in result["requests"])
    # Loaded back through the typed reader, the file round-trips.
    assert read_result_file(tmp_path / "result.json").metrics.completed == 3


def test_bad_options_exit_with_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m"]
    assert main([*base, "--num-prompts", "0"]) == 2
    assert "--num-prompts must be >= 1" in capsys.readouterr().err
    assert main([*base, "--extra-body", "[1]"]) == 2
    assert "--extra-body must be a JSON object" in capsys.readouterr().err
    assert main([*base, "--request-rate", "-1"]) == 2
    assert main([*base, "--tokenizer", "/nonexistent/tokenizer"]) == 2
    assert "cannot load the tokenizer" in capsys.readouterr().err
    assert main([*base, "--result-file", "/nonexistent/dir/r.json"]) == 2
    assert "--result-file: the directory" in capsys.readouterr().err


def test_python_dash_m_flowllm_bench_serve(start_server: StartServer, tmp_path: Path) -> None:
    server = start_server(ttft_s=0.02, itl_s=0.002)
    result = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "flowllm", "bench", "serve", "--base-url", server.base_url]
    cmd += ["--num-prompts", "4", "--random-input-len", "8", "--random-output-len", "3"]
    cmd += ["--max-concurrency", "2", "--result-file", str(result)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "Successful requests:                     4" in proc.stdout
    assert proc.stderr == ""  # not a terminal: no progress bar
    assert json.loads(result.read_text())["metrics"]["total_output_tokens"] == 12


def test_plot_file_is_written_when_matplotlib_is_installed(
    start_server: StartServer, tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    server = start_server(ttft_s=0.01, itl_s=0.002)
    plot = tmp_path / "latency.png"
    status, _ = bench(server, tmp_path, "--model", "m", "--plot", str(plot), n=6)
    assert status == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
