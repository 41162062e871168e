"""The progress bar, the result table, and the plot's optional dependency."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from flowllm.bench.metrics import RequestRecord, compute_metrics
from flowllm.bench.progress import ProgressBar, format_duration, render_bar
from flowllm.bench.report import format_errors, format_table, matplotlib_available, plot_latencies
from flowllm.cli import main


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_render_bar() -> None:
    assert render_bar(5, 20, 2.0, width=10) == " 25.0%|##        | 5/20 [00:02<00:06, 2.50 req/s]"
    assert render_bar(0, 20, 0.0, width=4) == "  0.0%|    | 0/20 [00:00<?, 0.00 req/s]"
    assert format_duration(3725) == "1:02:05"


def test_disabled_bar_writes_nothing() -> None:
    out = io.StringIO()
    bar = ProgressBar(3, out, enabled=False)
    for _ in range(3):
        bar.update()
    bar.close()
    assert out.getvalue() == "" and bar.done == 3


def test_enabled_bar_redraws_at_most_every_interval_and_ends_the_line() -> None:
    out, clock = io.StringIO(), FakeClock()
    bar = ProgressBar(10, out, enabled=True, min_interval=1.0, clock=clock)
    bar.update()  # first draw
    clock.now += 0.1
    bar.update()  # too soon: no draw
    clock.now += 1.0
    bar.update()  # drawn
    clock.now += 0.1
    bar.update(7)  # all done: always drawn
    bar.close()
    closed_early = io.StringIO()
    early = ProgressBar(10, closed_early, enabled=True, min_interval=1.0, clock=clock)
    early.update()
    clock.now += 0.1
    early.update()  # not drawn: close shows it
    early.close()
    assert closed_early.getvalue().count("\r") == 2
    assert closed_early.getvalue().endswith("| 2/10 [00:00<00:00, 20.00 req/s]\n")
    text = out.getvalue()
    assert text.count("\r") == 3  # close adds no redraw of the state already shown
    assert text.endswith("| 10/10 [00:01<00:00, 8.33 req/s]\n")


def _metrics():
    records = [
        RequestRecord(
            index=0,
            success=True,
            start_s=0.0,
            latency_s=0.5,
            ttft_s=0.1,
            itl_s=[0.2, 0.2],
            prompt_tokens=8,
            output_tokens=3,
        ),
        RequestRecord(index=1, success=False, start_s=0.0, latency_s=0.1, error="HTTP 500: x"),
    ]
    return records, compute_metrics(records, 1.0)


def test_table_lists_every_figure_like_vllm() -> None:
    _, metrics = _metrics()
    table = format_table(metrics, max_concurrency=4, request_rate=None, percentiles=(50, 90, 99))
    lines = table.splitlines()
    assert lines[0] == "=" * 12 + " Serving Benchmark Result " + "=" * 12
    assert lines[-1] == "=" * 50
    values = dict(
        re.match(r"(.+?:)\s+(\S+)$", line).groups()  # type: ignore[union-attr]
        for line in lines
        if re.match(r"(.+?:)\s+(\S+)$", line)
    )
    assert values["Successful requests:"] == "1"
    assert values["Failed requests:"] == "1"
    assert values["Maximum request concurrency:"] == "4"
    assert values["Request rate configured (RPS):"] == "inf"
    assert values["Total input tokens:"] == "8"
    assert values["Total generated tokens:"] == "3"
    assert values["Output token throughput (tok/s):"] == "3.00"
    assert values["Mean TTFT (ms):"] == "100.00"
    assert values["P90 TPOT (ms):"] == "200.00"
    assert values["P99 ITL (ms):"] == "200.00"
    assert values["Median E2EL (ms):"] == "500.00"
    for section in ("Time to First Token", "Inter-token Latency", "End-to-end Latency"):
        assert any(section in line and line.startswith("-") for line in lines)
    assert "1 x HTTP 500: x" in format_errors(metrics.errors)


@pytest.mark.skipif(matplotlib_available(), reason="matplotlib is installed")
def test_plot_without_matplotlib_is_refused_before_any_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Port 9 (discard) on loopback: nothing is ever sent, the option check comes first.
    argv = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m"]
    assert main([*argv, "--plot", str(tmp_path / "p.png")]) == 2
    assert "matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_plot_draws_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    records, metrics = _metrics()
    plot_latencies(records, metrics, tmp_path / "lat.png")
    assert (tmp_path / "lat.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
