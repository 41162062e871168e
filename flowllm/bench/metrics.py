"""Per-request records and the pure function that turns them into benchmark metrics.

Definitions follow vLLM's `bench serve`, so figures compare across servers:

- TTFT: from sending the request to the first event carrying non-empty text.
- ITL: the gaps between consecutive text events, pooled over all requests.
- TPOT: per request, `(e2e - ttft) / (output_tokens - 1)`, for requests with more than one
  output token; the statistics are over requests.
- E2EL: from sending the request to its last byte.
- Throughputs divide successful requests' totals by the benchmark's wall-clock duration.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import msgspec
import numpy as np

DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)
# Error messages are grouped verbatim; a long one (an HTML error page) is cut to this size.
MAX_ERROR_CHARS = 200


class MetricsError(ValueError):
    """The records or the duration given to `compute_metrics` are inconsistent."""


class RequestRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What one benchmark request did; times in seconds."""

    index: int  # position in the prompt list
    success: bool
    start_s: float  # when it was sent, relative to the benchmark's start
    latency_s: float  # end to end: sent -> last byte (or failure)
    ttft_s: float | None = None  # None: no text event arrived
    itl_s: list[float] = msgspec.field(default_factory=list)  # gaps between text events
    prompt_tokens: int = 0
    output_tokens: int = 0
    # True when the counts come from the server's `usage`, False when estimated locally.
    prompt_tokens_from_server: bool = False
    output_tokens_from_server: bool = False
    generated_text: str = ""
    error: str | None = None


class LatencyStats(msgspec.Struct, frozen=True, kw_only=True):
    """Summary of one latency distribution in milliseconds; values are None when empty."""

    count: int
    mean_ms: float | None
    median_ms: float | None
    std_ms: float | None
    min_ms: float | None
    max_ms: float | None
    percentiles_ms: dict[str, float]  # "p90" -> value; empty when count == 0


class BenchMetrics(msgspec.Struct, frozen=True, kw_only=True):
    """Aggregate figures of a benchmark run."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # successful requests per second
    output_throughput: float  # generated tokens per second
    total_token_throughput: float  # (input + generated) tokens per second
    peak_concurrency: int  # most requests in flight at once (successful and failed)
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    errors: dict[str, int]  # error message -> how many requests failed with it


def percentile_key(p: float) -> str:
    """The dictionary key of percentile `p`: 90 -> "p90", 99.9 -> "p99.9"."""
    return f"p{p:g}"


def latency_stats(values_s: Sequence[float], percentiles: Sequence[float]) -> LatencyStats:
    """Summarise latencies given in seconds; percentiles interpolate linearly (numpy's default)."""
    if not values_s:
        return LatencyStats(
            count=0,
            mean_ms=None,
            median_ms=None,
            std_ms=None,
            min_ms=None,
            max_ms=None,
            percentiles_ms={},
        )
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0  # [count]
    return LatencyStats(
        count=int(ms.size),
        mean_ms=float(ms.mean()),
        median_ms=float(np.median(ms)),
        std_ms=float(ms.std()),
        min_ms=float(ms.min()),
        max_ms=float(ms.max()),
        percentiles_ms={percentile_key(p): float(np.percentile(ms, p)) for p in percentiles},
    )


def request_tpot(record: RequestRecord) -> float | None:
    """Time per output token after the first, in seconds; None when it is undefined."""
    if not record.success or record.ttft_s is None or record.output_tokens < 2:
        return None
    return (record.latency_s - record.ttft_s) / (record.output_tokens - 1)


def peak_concurrency(records: Sequence[RequestRecord]) -> int:
    """The most requests whose [start, start + latency) intervals overlap at one instant."""
    # An end sorts before a start at the same instant: back-to-back requests do not overlap.
    events = sorted(
        [(r.start_s, 1) for r in records] + [(r.start_s + r.latency_s, -1) for r in records]
    )
    peak = current = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    return peak


def summarize_errors(records: Sequence[RequestRecord]) -> dict[str, int]:
    """Failed requests grouped by error message, most frequent first."""
    counts = Counter(
        (r.error or "unknown error")[:MAX_ERROR_CHARS] for r in records if not r.success
    )
    return dict(counts.most_common())


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> BenchMetrics:
    """Aggregate per-request records of a run that lasted `duration_s` seconds.

    Pure: the same records always give the same metrics, so it is tested on hand-computed
    numbers and reused by anything that re-analyses a saved result file.
    """
    if not duration_s > 0.0:
        raise MetricsError(f"duration_s must be > 0, got {duration_s}")
    for p in percentiles:
        if not 0.0 <= p <= 100.0:
            raise MetricsError(f"percentiles must lie in [0, 100], got {p}")
    for r in records:
        if r.latency_s < 0.0 or (r.ttft_s is not None and r.ttft_s < 0.0):
            raise MetricsError(f"request {r.index} has a negative latency")

    ok = [r for r in records if r.success]
    total_input = sum(r.prompt_tokens for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    tpots = [t for t in (request_tpot(r) for r in ok) if t is not None]
    return BenchMetrics(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        peak_concurrency=peak_concurrency(records),
        ttft=latency_stats([r.ttft_s for r in ok if r.ttft_s is not None], percentiles),
        tpot=latency_stats(tpots, percentiles),
        itl=latency_stats([gap for r in ok for gap in r.itl_s], percentiles),
        e2el=latency_stats([r.latency_s for r in ok], percentiles),
        errors=summarize_errors(records),
    )
