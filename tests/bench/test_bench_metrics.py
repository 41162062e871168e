"""compute_metrics against hand-computed figures, and its statistics against `statistics`."""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowllm.bench.metrics import (
    MAX_ERROR_CHARS,
    MetricsError,
    RequestRecord,
    compute_metrics,
    latency_stats,
    peak_concurrency,
    percentile_key,
    request_tpot,
)


def ok(
    index: int,
    start: float,
    latency: float,
    ttft: float | None,
    itl: list[float],
    prompt: int,
    output: int,
) -> RequestRecord:
    return RequestRecord(
        index=index,
        success=True,
        start_s=start,
        latency_s=latency,
        ttft_s=ttft,
        itl_s=itl,
        prompt_tokens=prompt,
        output_tokens=output,
    )


def failed(index: int, start: float, latency: float, error: str) -> RequestRecord:
    return RequestRecord(index=index, success=False, start_s=start, latency_s=latency, error=error)


RECORDS = [
    ok(0, start=0.0, latency=1.0, ttft=0.2, itl=[0.2, 0.3, 0.3], prompt=10, output=4),
    ok(1, start=0.5, latency=0.5, ttft=0.1, itl=[0.4], prompt=20, output=2),
    # A failed request's tokens, TTFT and latency stay out of every figure but concurrency.
    RequestRecord(
        index=2,
        success=False,
        start_s=0.6,
        latency_s=0.1,
        ttft_s=0.05,
        itl_s=[9.0],
        prompt_tokens=99,
        output_tokens=99,
        error="HTTP 500: boom",
    ),
    ok(3, start=1.2, latency=0.3, ttft=0.3, itl=[], prompt=5, output=1),
]


def test_hand_computed_totals_and_throughputs() -> None:
    m = compute_metrics(RECORDS, duration_s=2.0)
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (35, 7)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(3.5)
    assert m.total_token_throughput == pytest.approx(21.0)
    # [0, 1.0), [0.5, 1.0), [0.6, 0.7) overlap at 0.6; [1.2, 1.5) is alone.
    assert m.peak_concurrency == 3
    assert m.errors == {"HTTP 500: boom": 1}


def test_hand_computed_latency_statistics() -> None:
    m = compute_metrics(RECORDS, duration_s=2.0)
    # TTFT over successful requests: 200, 100, 300 ms.
    assert m.ttft.count == 3
    assert m.ttft.mean_ms == pytest.approx(200.0)
    assert m.ttft.median_ms == pytest.approx(200.0)
    assert m.ttft.std_ms == pytest.approx(math.sqrt(20000 / 3))
    assert (m.ttft.min_ms, m.ttft.max_ms) == (pytest.approx(100.0), pytest.approx(300.0))
    # Linear interpolation on [100, 200, 300]: rank 0.9 * 2 = 1.8 -> 280; 0.99 * 2 -> 298.
    assert m.ttft.percentiles_ms == {
        "p50": pytest.approx(200.0),
        "p90": pytest.approx(280.0),
        "p99": pytest.approx(298.0),
    }
    # TPOT: (1.0 - 0.2) / 3 = 266.67 ms and (0.5 - 0.1) / 1 = 400 ms; one output token: none.
    assert m.tpot.count == 2
    assert m.tpot.mean_ms == pytest.approx(1000.0 / 3)
    assert m.tpot.percentiles_ms["p90"] == pytest.approx(800.0 / 3 + 0.9 * 400.0 / 3)
    # ITL pools every gap: 200, 300, 300, 400 ms; rank 0.9 * 3 = 2.7 -> 370.
    assert m.itl.count == 4
    assert m.itl.mean_ms == pytest.approx(300.0)
    assert m.itl.median_ms == pytest.approx(300.0)
    assert m.itl.percentiles_ms["p90"] == pytest.approx(370.0)
    assert m.itl.percentiles_ms["p99"] == pytest.approx(397.0)
    # E2EL: 1000, 500, 300 ms.
    assert m.e2el.mean_ms == pytest.approx(600.0)
    assert m.e2el.median_ms == pytest.approx(500.0)
    assert m.e2el.percentiles_ms["p90"] == pytest.approx(900.0)
    assert m.e2el.percentiles_ms["p99"] == pytest.approx(990.0)


def test_request_tpot_is_undefined_without_two_tokens_or_a_first_token() -> None:
    assert request_tpot(ok(0, 0.0, 1.0, 0.2, [], 1, 1)) is None
    assert request_tpot(ok(0, 0.0, 1.0, None, [], 1, 5)) is None
    assert request_tpot(failed(0, 0.0, 1.0, "x")) is None
    assert request_tpot(ok(0, 0.0, 1.0, 0.2, [], 1, 5)) == pytest.approx(0.2)


def test_no_successful_request_gives_zero_throughput_and_empty_statistics() -> None:
    m = compute_metrics([failed(0, 0.0, 0.5, "refused"), failed(1, 0.0, 0.5, "refused")], 1.0)
    assert (m.completed, m.failed, m.request_throughput, m.output_throughput) == (0, 2, 0.0, 0.0)
    for stats in (m.ttft, m.tpot, m.itl, m.e2el):
        assert stats.count == 0
        assert stats.mean_ms is None and stats.median_ms is None
        assert stats.percentiles_ms == {}
    assert m.errors == {"refused": 2}


def test_errors_grouped_most_frequent_first_and_truncated() -> None:
    long = "x" * (MAX_ERROR_CHARS + 50)
    records = [failed(0, 0, 0.1, "a"), failed(1, 0, 0.1, "b"), failed(2, 0, 0.1, "b")]
    records += [failed(3, 0, 0.1, long), failed(4, 0, 0.1, long + "different tail")]
    m = compute_metrics(records, 1.0)
    assert list(m.errors.items()) == [("b", 2), ("x" * MAX_ERROR_CHARS, 2), ("a", 1)]


def test_back_to_back_requests_do_not_overlap() -> None:
    records = [ok(i, float(i), 1.0, 0.1, [], 1, 1) for i in range(5)]
    assert peak_concurrency(records) == 1
    assert peak_concurrency([]) == 0


def test_custom_percentiles_and_keys() -> None:
    m = compute_metrics(RECORDS, 2.0, percentiles=(25, 99.9))
    assert set(m.e2el.percentiles_ms) == {"p25", "p99.9"}
    assert m.e2el.percentiles_ms["p25"] == pytest.approx(400.0)  # 300 + 0.5 * 200
    assert percentile_key(50.0) == "p50"


@pytest.mark.parametrize(
    ("records", "duration", "percentiles"),
    [
        (RECORDS, 0.0, (50,)),
        (RECORDS, float("nan"), (50,)),
        (RECORDS, 1.0, (101,)),
        ([ok(0, 0.0, -1.0, 0.1, [], 1, 1)], 1.0, (50,)),
    ],
)
def test_inconsistent_input_is_refused(
    records: list[RequestRecord], duration: float, percentiles: tuple[float, ...]
) -> None:
    with pytest.raises(MetricsError):
        compute_metrics(records, duration, percentiles)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 100.0, allow_nan=False), min_size=2, max_size=40))
def test_latency_stats_match_the_statistics_module(values: list[float]) -> None:
    stats = latency_stats(values, percentiles=(10, 50, 90))
    ms = [v * 1000.0 for v in values]
    # statistics.quantiles(method="inclusive") interpolates linearly, as numpy does.
    deciles = statistics.quantiles(ms, n=10, method="inclusive")
    assert stats.mean_ms == pytest.approx(statistics.fmean(ms), abs=1e-6)
    assert stats.median_ms == pytest.approx(statistics.median(ms), abs=1e-6)
    assert stats.std_ms == pytest.approx(statistics.pstdev(ms), abs=1e-6)
    assert stats.percentiles_ms["p10"] == pytest.approx(deciles[0], abs=1e-6)
    assert stats.percentiles_ms["p90"] == pytest.approx(deciles[8], abs=1e-6)
