"""`flowllm bench serve`: load an OpenAI-compatible server and report its latencies.

A run builds random prompts, sends them as streamed requests at a chosen rate (a Poisson
process, or all at once) under an optional cap on requests in flight, times each request
event by event (`flowllm.bench.client`), then aggregates the records
(`flowllm.bench.metrics.compute_metrics`) into the table vLLM users know, a JSON result
file and, with matplotlib, a PNG of the latency distributions.

The run always ends: every request has a deadline (`request_timeout`), and the arrival
schedule is finite.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import anyio
import httpx
import msgspec
import numpy as np

from flowllm.bench.args import Endpoint
from flowllm.bench.client import (
    ServerError,
    api_root,
    build_body,
    endpoint_url,
    send_request,
)
from flowllm.bench.metrics import (
    DEFAULT_PERCENTILES,
    BenchMetrics,
    RequestRecord,
    compute_metrics,
)
from flowllm.bench.progress import ProgressBar
from flowllm.bench.prompts import (
    Prompt,
    PromptError,
    TokenizerLike,
    load_tokenizer,
    random_prompts,
)
from flowllm.bench.report import (
    PlotUnavailableError,
    format_errors,
    format_table,
    matplotlib_available,
    plot_latencies,
)


class BenchConfigError(ValueError):
    """A benchmark option is out of range; the message names the flag."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise BenchConfigError(message)


class BenchServeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Every option of a run, validated once when built."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: Endpoint = "completions"
    model: str | None = None  # None: the first model the server lists
    tokenizer: str | None = None  # local directory; None: random-word prompts
    num_prompts: int = 1000
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    max_concurrency: int | None = None  # None: no cap
    request_rate: float | None = None  # requests/s; None: all at once
    burstiness: float = 1.0
    seed: int = 0
    ignore_eos: bool = True
    extra_body: dict[str, Any] = msgspec.field(default_factory=dict)
    api_key: str | None = None
    request_timeout: float = 600.0  # seconds, per request, end to end
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    result_file: str | None = None
    plot: str | None = None
    disable_progress: bool = False
    trust_env: bool = False

    def __post_init__(self) -> None:
        _require(
            self.base_url.startswith(("http://", "https://")),
            f"--base-url must start with http:// or https://, got {self.base_url!r}",
        )
        _require(self.num_prompts >= 1, f"--num-prompts must be >= 1, got {self.num_prompts}")
        _require(
            self.random_input_len >= 1,
            f"--random-input-len must be >= 1, got {self.random_input_len}",
        )
        _require(
            self.random_output_len >= 1,
            f"--random-output-len must be >= 1, got {self.random_output_len}",
        )
        _require(
            0.0 <= self.random_range_ratio < 1.0,
            f"--random-range-ratio must lie in [0, 1), got {self.random_range_ratio}",
        )
        _require(
            self.max_concurrency is None or self.max_concurrency >= 1,
            f"--max-concurrency must be >= 1, got {self.max_concurrency}",
        )
        _require(
            self.request_rate is None
            or (math.isfinite(self.request_rate) and self.request_rate > 0),
            f"--request-rate must be > 0 or inf, got {self.request_rate}",
        )
        _require(
            math.isfinite(self.burstiness) and self.burstiness > 0,
            f"--burstiness must be > 0, got {self.burstiness}",
        )
        _require(
            math.isfinite(self.request_timeout) and self.request_timeout > 0,
            f"--request-timeout must be > 0, got {self.request_timeout}",
        )
        _require(len(self.percentiles) > 0, "--percentiles must name at least one percentile")
        _require(
            all(0.0 <= p <= 100.0 for p in self.percentiles),
            f"--percentiles must lie in [0, 100], got {list(self.percentiles)}",
        )

    def public(self) -> dict[str, Any]:
        """The options as JSON-ready builtins, without the API key."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        out["api_key"] = "***" if self.api_key else None
        out["request_rate"] = "inf" if self.request_rate is None else self.request_rate
        return out


class BenchResult(msgspec.Struct, frozen=True, kw_only=True):
    """A finished run: what the result file holds."""

    date: str  # ISO 8601, UTC, when the run started
    model: str
    url: str
    config: dict[str, Any]  # BenchServeConfig.public()
    metrics: BenchMetrics
    requests: list[RequestRecord]


def _parse_extra_body(text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        value = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise BenchConfigError(f"--extra-body is not valid JSON: {exc}") from exc
    _require(isinstance(value, dict), "--extra-body must be a JSON object")
    return dict(value)


def _parse_percentiles(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError as exc:
        raise BenchConfigError(f"--percentiles must be numbers like 50,90,99: {text!r}") from exc


def config_from_args(args: argparse.Namespace) -> BenchServeConfig:
    """Build the run's options from parsed flags (see `flowllm.bench.args`)."""
    rate = float(args.request_rate)
    _require(not math.isnan(rate), "--request-rate must be a number or inf")
    return BenchServeConfig(
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=args.model,
        tokenizer=args.tokenizer,
        num_prompts=args.num_prompts,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        max_concurrency=args.max_concurrency,
        request_rate=None if math.isinf(rate) and rate > 0 else rate,
        burstiness=args.burstiness,
        seed=args.seed,
        ignore_eos=not args.no_ignore_eos,
        extra_body=_parse_extra_body(args.extra_body),
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None,
        request_timeout=args.request_timeout,
        percentiles=_parse_percentiles(args.percentiles),
        result_file=args.result_file,
        plot=args.plot,
        disable_progress=args.disable_tqdm,
        trust_env=args.trust_env,
    )


def arrival_offsets(
    count: int, request_rate: float | None, burstiness: float, seed: int
) -> list[float]:
    """When each request is due, in seconds after the start; the first is due at once.

    Gaps are gamma-distributed with mean 1/rate; shape `burstiness` = 1 makes the arrivals
    a Poisson process (vLLM's model). The generator is seeded apart from the prompts', so
    changing the rate leaves the prompts alone.
    """
    if request_rate is None:
        return [0.0] * count
    rng = np.random.default_rng([seed, 1])
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=count - 1)
    return [0.0, *(float(t) for t in np.cumsum(gaps))]


def _headers(config: BenchServeConfig) -> dict[str, str]:
    headers = {"User-Agent": "flowllm-bench"}
    if config.api_key:
        headers["Authorization"] = f"Bearer {config.api_key}"
    return headers


async def fetch_model_id(config: BenchServeConfig) -> str:
    """The first model the server lists at /v1/models (what vLLM's bench does without --model)."""
    url = api_root(config.base_url) + "/v1/models"
    try:
        with anyio.fail_after(config.request_timeout):
            async with httpx.AsyncClient(
                headers=_headers(config), trust_env=config.trust_env, timeout=config.request_timeout
            ) as client:
                response = await client.get(url)
    except (TimeoutError, httpx.HTTPError) as exc:
        raise ServerError(f"cannot list models at {url}: {type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        raise ServerError(f"cannot list models at {url}: HTTP {response.status_code}")
    try:
        data = msgspec.json.decode(response.content)
    except msgspec.DecodeError as exc:
        raise ServerError(f"cannot list models at {url}: the answer is not JSON") from exc
    models = data.get("data") if isinstance(data, dict) else None
    if not isinstance(models, list) or not models or not isinstance(models[0], dict):
        raise ServerError(f"no model listed at {url}; pass --model")
    return str(models[0].get("id"))


async def run_requests(
    config: BenchServeConfig,
    model: str,
    prompts: Sequence[Prompt],
    *,
    count_tokens: Callable[[str], int] | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send every prompt on the arrival schedule; the records (in prompt order) and duration.

    The duration runs from the first send to the last request's end.
    """
    url = endpoint_url(config.base_url, config.endpoint)
    offsets = arrival_offsets(len(prompts), config.request_rate, config.burstiness, config.seed)
    limits = httpx.Limits(
        max_connections=config.max_concurrency, max_keepalive_connections=config.max_concurrency
    )
    records: list[RequestRecord | None] = [None] * len(prompts)
    slots = anyio.Semaphore(config.max_concurrency) if config.max_concurrency else None

    async with httpx.AsyncClient(
        headers=_headers(config),
        limits=limits,
        timeout=config.request_timeout,
        trust_env=config.trust_env,
    ) as client:
        t0 = time.perf_counter()

        async def one(index: int, prompt: Prompt) -> None:
            body = build_body(
                config.endpoint,
                model,
                prompt,
                ignore_eos=config.ignore_eos,
                extra_body=config.extra_body,
            )
            kwargs: dict[str, Any] = {
                "endpoint": config.endpoint,
                "index": index,
                "prompt_len": prompt.prompt_len,
                "timeout_s": config.request_timeout,
                "t0": t0,
                "count_tokens": count_tokens,
            }
            if slots is None:
                record = await send_request(client, url, body, **kwargs)
            else:
                async with slots:
                    record = await send_request(client, url, body, **kwargs)
            records[index] = record
            if on_done is not None:
                on_done(record)

        async with anyio.create_task_group() as tg:
            for index, (prompt, offset) in enumerate(zip(prompts, offsets, strict=True)):
                delay = t0 + offset - time.perf_counter()
                if delay > 0:
                    await anyio.sleep(delay)
                tg.start_soon(one, index, prompt)
        duration = time.perf_counter() - t0
    return [r for r in records if r is not None], duration


def build_prompts(config: BenchServeConfig, tokenizer: TokenizerLike | None = None) -> list[Prompt]:
    """The run's random prompts (deterministic for a seed and tokenizer)."""
    return random_prompts(
        config.num_prompts,
        config.random_input_len,
        config.random_output_len,
        seed=config.seed,
        range_ratio=config.random_range_ratio,
        tokenizer=tokenizer,
    )


def _token_counter(tokenizer: TokenizerLike) -> Callable[[str], int]:
    """Counts generated tokens locally, for servers that report no `usage`."""

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    return count


async def benchmark(
    config: BenchServeConfig,
    *,
    tokenizer: TokenizerLike | None = None,
    progress_stream: TextIO | None = None,
    log: TextIO | None = None,
) -> BenchResult:
    """Run one benchmark and return its result (the programmatic face of the command).

    `progress_stream` gets the progress bar when given; `log` gets the preamble lines.
    Raises `ServerError` only when no model is given and the server lists none.
    """
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    model = config.model or await fetch_model_id(config)
    prompts = build_prompts(config, tokenizer)
    url = endpoint_url(config.base_url, config.endpoint)
    if log is not None:
        rate = "inf" if config.request_rate is None else f"{config.request_rate:g}"
        print(
            f"Benchmarking {model} at {url}: {len(prompts)} prompts of ~{config.random_input_len} "
            f"tokens, max_tokens {config.random_output_len}, request rate {rate}, "
            f"max concurrency {config.max_concurrency or '-'}",
            file=log,
        )
    count_tokens = _token_counter(tokenizer) if tokenizer is not None else None
    bar = ProgressBar(
        len(prompts),
        progress_stream or sys.stderr,
        enabled=progress_stream is not None and not config.disable_progress,
    )
    try:
        records, duration = await run_requests(
            config, model, prompts, count_tokens=count_tokens, on_done=lambda _: bar.update()
        )
    finally:
        bar.close()
    metrics = compute_metrics(records, duration, config.percentiles)
    return BenchResult(
        date=date, model=model, url=url, config=config.public(), metrics=metrics, requests=records
    )


def write_result_file(result: BenchResult, path: str | Path) -> None:
    """Write the result as indented JSON (config, aggregate metrics, per-request records)."""
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(result), indent=2) + b"\n")


def read_result_file(path: str | Path) -> BenchResult:
    """Load a result file written by `write_result_file`."""
    return msgspec.json.decode(Path(path).read_bytes(), type=BenchResult)


def _error(message: str) -> None:
    print(f"flowllm bench serve: error: {message}", file=sys.stderr)


def serve_command(args: argparse.Namespace) -> int:
    """Entry point of `flowllm bench serve`.

    Exit status: 0 when at least one request succeeded, 1 when none did (or the server
    could not be asked for a model), 2 for bad options.
    """
    try:
        config = config_from_args(args)
    except BenchConfigError as exc:
        _error(str(exc))
        return 2
    for flag, target in (("--result-file", config.result_file), ("--plot", config.plot)):
        if target is not None and not Path(target).resolve().parent.is_dir():
            _error(f"{flag}: the directory of {target!r} does not exist")
            return 2
    if config.plot is not None and not matplotlib_available():
        _error("--plot needs matplotlib, which is not installed (pip install 'flowllm[bench]')")
        return 2
    tokenizer = None
    if config.tokenizer is not None:
        try:
            tokenizer = load_tokenizer(config.tokenizer)
        except (OSError, ValueError, KeyError) as exc:
            _error(f"cannot load the tokenizer from {config.tokenizer!r}: {exc}")
            return 2

    show_progress = sys.stderr.isatty() and not config.disable_progress
    try:
        result = anyio.run(
            lambda: benchmark(
                config,
                tokenizer=tokenizer,
                progress_stream=sys.stderr if show_progress else None,
                log=sys.stdout,
            )
        )
    except ServerError as exc:
        _error(str(exc))
        return 1
    except PromptError as exc:
        _error(str(exc))
        return 2
    except KeyboardInterrupt:
        _error("interrupted")
        return 130

    print(
        format_table(
            result.metrics,
            max_concurrency=config.max_concurrency,
            request_rate=config.request_rate,
            percentiles=config.percentiles,
        )
    )
    if result.metrics.errors:
        print(format_errors(result.metrics.errors))
    if config.result_file is not None:
        try:
            write_result_file(result, config.result_file)
        except OSError as exc:
            _error(f"cannot write {config.result_file!r}: {exc}")
            return 1
        print(f"Results written to {config.result_file}")
    if config.plot is not None:
        try:
            plot_latencies(result.requests, result.metrics, config.plot)
        except PlotUnavailableError as exc:
            _error(str(exc))
            return 2
        print(f"Plot written to {config.plot}")
    sys.stdout.flush()
    return 0 if result.metrics.completed > 0 else 1
