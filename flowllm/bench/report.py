"""Presenting a run: the result table (laid out like vLLM's) and an optional latency plot.

matplotlib is optional: it is imported only when a plot is asked for, and
`matplotlib_available` lets the command refuse `--plot` before the run rather than after.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

from flowllm.bench.metrics import (
    BenchMetrics,
    LatencyStats,
    RequestRecord,
    percentile_key,
    request_tpot,
)

_WIDTH = 50
_LABEL = 40

# (attribute of BenchMetrics, short name, section title)
_SECTIONS: tuple[tuple[str, str, str], ...] = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


class PlotUnavailableError(RuntimeError):
    """`--plot` was asked for but matplotlib is not installed."""


def _line(label: str, value: object) -> str:
    return f"{label:<{_LABEL}} {value!s:<10}".rstrip()


def _title(text: str, fill: str) -> str:
    return f"{text:{fill}^{_WIDTH}}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _stats_lines(name: str, stats: LatencyStats, percentiles: Sequence[float]) -> list[str]:
    lines = [
        _line(f"Mean {name} (ms):", _ms(stats.mean_ms)),
        _line(f"Median {name} (ms):", _ms(stats.median_ms)),
    ]
    for p in percentiles:
        if p == 50.0:
            continue  # the median, already shown
        key = percentile_key(p)
        lines.append(_line(f"{key.upper()} {name} (ms):", _ms(stats.percentiles_ms.get(key))))
    return lines


def format_table(
    metrics: BenchMetrics,
    *,
    max_concurrency: int | None,
    request_rate: float | None,
    percentiles: Sequence[float],
) -> str:
    """The human-readable result, one figure per line, as `vllm bench serve` prints it."""
    lines = [
        _title(" Serving Benchmark Result ", "="),
        _line("Successful requests:", metrics.completed),
        _line("Failed requests:", metrics.failed),
        _line("Maximum request concurrency:", max_concurrency if max_concurrency else "-"),
        _line("Request rate configured (RPS):", "inf" if request_rate is None else request_rate),
        _line("Benchmark duration (s):", f"{metrics.duration_s:.2f}"),
        _line("Total input tokens:", metrics.total_input_tokens),
        _line("Total generated tokens:", metrics.total_output_tokens),
        _line("Request throughput (req/s):", f"{metrics.request_throughput:.2f}"),
        _line("Output token throughput (tok/s):", f"{metrics.output_throughput:.2f}"),
        _line("Total token throughput (tok/s):", f"{metrics.total_token_throughput:.2f}"),
        _line("Peak concurrent requests:", metrics.peak_concurrency),
    ]
    for attr, name, title in _SECTIONS:
        lines.append(_title(title, "-"))
        lines.extend(_stats_lines(name, getattr(metrics, attr), percentiles))
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def format_errors(errors: dict[str, int], limit: int = 10) -> str:
    """The most frequent failure messages with their counts, one per line."""
    lines = [f"Errors ({sum(errors.values())} failed requests):"]
    for message, count in list(errors.items())[:limit]:
        lines.append(f"  {count:>6} x {message}")
    if len(errors) > limit:
        lines.append(f"  ... and {len(errors) - limit} other messages")
    return "\n".join(lines)


def matplotlib_available() -> bool:
    """Whether matplotlib can be imported, without importing it."""
    return importlib.util.find_spec("matplotlib") is not None


def plot_latencies(
    records: Sequence[RequestRecord], metrics: BenchMetrics, path: str | Path
) -> None:
    """Draw TTFT, TPOT, ITL and E2EL histograms (ms) with mean and p99 marks into a PNG."""
    if not matplotlib_available():
        raise PlotUnavailableError(
            "--plot needs matplotlib, which is not installed (pip install 'flowllm[bench]')"
        )
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.success]
    samples_ms = {
        "ttft": [r.ttft_s * 1000.0 for r in ok if r.ttft_s is not None],
        "tpot": [t * 1000.0 for t in (request_tpot(r) for r in ok) if t is not None],
        "itl": [gap * 1000.0 for r in ok for gap in r.itl_s],
        "e2el": [r.latency_s * 1000.0 for r in ok],
    }
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (attr, name, title) in zip(axes.flat, _SECTIONS, strict=True):
        values = samples_ms[attr]
        stats: LatencyStats = getattr(metrics, attr)
        if values:
            ax.hist(values, bins=min(50, max(5, len(values) // 4)), color="#4c72b0")
            if stats.mean_ms is not None:
                ax.axvline(stats.mean_ms, color="#dd8452", label=f"mean {stats.mean_ms:.1f}")
            p99 = stats.percentiles_ms.get("p99")
            if p99 is not None:
                ax.axvline(p99, color="#c44e52", linestyle="--", label=f"p99 {p99:.1f}")
            ax.legend(loc="upper right", fontsize=8)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{name}: {title}", fontsize=10)
        ax.set_xlabel("ms")
        ax.set_ylabel("count")
    fig.suptitle(
        f"{metrics.completed} requests ({metrics.failed} failed) in {metrics.duration_s:.1f} s, "
        f"{metrics.output_throughput:.1f} output tok/s"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
