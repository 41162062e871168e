"""Command-line flags of `flowllm bench serve`, named as in `vllm bench serve`.

Only argparse here, so building the `flowllm` parser stays fast; the flags become a
validated `BenchServeConfig` in `flowllm.bench.serve`.
"""

from __future__ import annotations

import argparse
from typing import Literal, get_args

# The OpenAI endpoints a run sends to; here, so the flag's choices need nothing heavier.
Endpoint = Literal["completions", "chat"]


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the flags of `flowllm bench serve` on `parser`."""
    target = parser.add_argument_group("server")
    target.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="server root, with or without /v1 (default: %(default)s)",
    )
    target.add_argument(
        "--endpoint",
        choices=get_args(Endpoint),
        default="completions",
        help="/v1/completions or /v1/chat/completions (default: %(default)s)",
    )
    target.add_argument(
        "--model", default=None, help="the request's `model` field (default: the server's first)"
    )
    target.add_argument(
        "--api-key",
        default=None,
        help="sent as `Authorization: Bearer KEY` (default: $OPENAI_API_KEY if set)",
    )
    target.add_argument(
        "--extra-body",
        default=None,
        metavar="JSON",
        help="a JSON object merged into every request body, e.g. '{\"temperature\": 0}'",
    )
    target.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send `ignore_eos: true` (needed by servers that reject unknown fields)",
    )
    target.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="a request still unfinished after this counts as failed (default: %(default)s)",
    )
    target.add_argument(
        "--trust-env",
        action="store_true",
        help="honour HTTP(S)_PROXY and similar environment settings (off: connect directly)",
    )

    data = parser.add_argument_group("prompts")
    data.add_argument("--num-prompts", type=int, default=1000, help="default: %(default)s")
    data.add_argument(
        "--random-input-len", type=int, default=1024, help="prompt tokens (default: %(default)s)"
    )
    data.add_argument(
        "--random-output-len",
        type=int,
        default=128,
        help="max_tokens of each request (default: %(default)s)",
    )
    data.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="draw lengths uniformly within len * (1 +- ratio) (default: %(default)s)",
    )
    data.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="local tokenizer directory: prompts of exact token lengths (else random words)",
    )
    data.add_argument("--seed", type=int, default=0, help="prompts and arrivals (default: 0)")

    load = parser.add_argument_group("load")
    load.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="most requests in flight at once (default: no limit)",
    )
    load.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, a Poisson process; inf sends all at once (default: inf)",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps; 1 is Poisson, lower is burstier (default: 1)",
    )

    out = parser.add_argument_group("output")
    out.add_argument(
        "--percentiles",
        default="50,90,99",
        help="comma-separated latency percentiles to report (default: %(default)s)",
    )
    out.add_argument("--result-file", default=None, metavar="FILE.json", help="write results")
    out.add_argument(
        "--plot", default=None, metavar="FILE.png", help="latency histograms (needs matplotlib)"
    )
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar on stderr")
