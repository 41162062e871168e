"""Fuzzing every endpoint: no request, however malformed, gets a 5xx or takes the server
down, and none leaves state behind.

After every case the answer must be below 500 (a 4xx from a POST endpoint in OpenAI's
error shape) and /health must answer 200 within a second; after the last, no KV block, no
running or waiting sequence, no request mailbox and no per-sequence state may remain.
The cases (fuzz_cases.py) are drawn from the request structs' JSON schemas and mixed with
the mutations that break servers. CI scale runs 2,000 derandomized cases (the same ones
every run); full scale 10,000 from a fresh seed (FLOWLLM_RELIABILITY_SEED fixes it).
"""

from __future__ import annotations

import collections
import json
import os
import random
import time

import httpx
import hypothesis
from fuzz_cases import POST_ENDPOINTS, Case, all_cases
from hypothesis import HealthCheck, Phase, given, settings
from reliability_helpers import FULL, leftovers, report, scaled, wait_for_no_leftovers
from server_process import ServerProcess

CASES = scaled(2000, 10_000)
HEALTH_TIMEOUT = 1.0  # seconds /health may take after each case
REQUEST_TIMEOUT = 60.0  # seconds before a case counts as a hang
# Hypothesis profiles of their own: no example database, no deadline, no health checks,
# and no shrinking: the request that failed is the one reported, and a server brought
# down by one request would make every later one fail. CI draws the same cases every run.
for _scale, _derandomize in (("ci", True), ("full", False)):
    settings.register_profile(
        f"flowllm-reliability-{_scale}",
        max_examples=CASES,
        derandomize=_derandomize,
        database=None,
        deadline=None,
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )
SETTINGS = settings.get_profile(f"flowllm-reliability-{'full' if FULL else 'ci'}")


class Fuzzer:
    """Sends cases to one server and checks each answer; keeps the figures."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.client = httpx.Client(timeout=httpx.Timeout(REQUEST_TIMEOUT, connect=10.0))
        self.health = httpx.Client(timeout=HEALTH_TIMEOUT)
        self.statuses: collections.Counter[int] = collections.Counter()
        self.kinds: collections.Counter[str] = collections.Counter()
        self.recent: collections.deque[str] = collections.deque(maxlen=10)
        self.slowest: tuple[float, str] = (0.0, "")
        self.problems: dict[str, str] = {}  # the first case of each kind of problem
        self.problem_counts: collections.Counter[str] = collections.Counter()

    def close(self) -> None:
        self.client.close()
        self.health.close()

    def fail(self, problem: str, case: Case, *, fatal: bool = True) -> None:
        """A fatal problem (no answer, /health down) stops the run at once; any other is
        recorded once per kind and the run goes on, so one run shows every bug."""
        alive = self.server.process.poll()
        state = "running" if alive is None else f"EXITED with {alive}"
        log = self.server.output()[-(4000 if fatal else 1500) :]
        earlier = "\n  ".join(self.recent) or "(none)"
        message = (
            f"{problem}\n\nThe request:\n{case.describe()}\n\n"
            f"Server process: {state}. The cases before it:\n  {earlier}\n\n"
            f"Server log (tail):\n{log}"
        )
        if fatal or alive is not None:
            raise AssertionError(message)
        kind = f"{case.method} {case.path}: {problem[:130]}"
        self.problems.setdefault(kind, message)
        self.problem_counts[kind] += 1

    def run(self, case: Case) -> None:
        url = f"{self.server.url}{case.path}"
        assert url.startswith("http://127.0.0.1:")
        started = time.monotonic()
        try:
            response = self.client.request(
                case.method, url, content=case.body, headers=case.request_headers()
            )
        except httpx.HTTPError as exc:
            self.fail(f"No answer: {type(exc).__name__}: {exc}", case)
            return
        elapsed = time.monotonic() - started
        self.statuses[response.status_code] += 1
        self.kinds[case.how.split(" [")[0].split(" ")[0]] += 1
        self.slowest = max(self.slowest, (elapsed, case.describe()[:300]))
        if response.status_code >= 500:
            self.fail(
                f"Server error {response.status_code} after {elapsed:.2f} s: "
                f"{response.text[:2000]}",
                case,
                fatal=False,
            )
        if case.method == "POST" and case.path in POST_ENDPOINTS:
            self.check_body(case, response)
        self.recent.append(
            f"{case.method} {case.path[:80]} [{case.how[:80]}] -> {response.status_code}"
        )
        probe = time.monotonic()
        try:
            health = self.health.get(f"{self.server.url}/health")
        except httpx.HTTPError as exc:
            self.fail(
                f"/health did not answer within {HEALTH_TIMEOUT} s after this request "
                f"(which got {response.status_code}): {type(exc).__name__}",
                case,
            )
            return
        waited = time.monotonic() - probe
        if waited > HEALTH_TIMEOUT:
            self.fail(
                f"/health took {waited:.2f} s after this request (which got "
                f"{response.status_code}); the limit is {HEALTH_TIMEOUT} s",
                case,
            )
        if health.status_code != 200:
            self.fail(
                f"/health answered {health.status_code} after this request "
                f"(which got {response.status_code}): {health.text[:500]}",
                case,
            )

    def check_body(self, case: Case, response: httpx.Response) -> None:
        """4xx: OpenAI's error body; 200: JSON, or an SSE stream ending in [DONE]."""
        status, text = response.status_code, response.text
        content_type = response.headers.get("content-type", "")
        if 400 <= status < 500:
            try:
                error = json.loads(text)["error"]
                shaped = isinstance(error, dict) and isinstance(error.get("message"), str)
            except (ValueError, KeyError, TypeError):
                shaped = False
            if not shaped:
                self.fail(
                    f"{status} without OpenAI's error body: {text[:1000]!r}", case, fatal=False
                )
        elif status == 200:
            if content_type.startswith("text/event-stream"):
                if not text.rstrip().endswith("data: [DONE]"):
                    self.fail(
                        f"An SSE stream that does not end in [DONE]: {text[-1000:]!r}",
                        case,
                        fatal=False,
                    )
            else:
                try:
                    json.loads(text)
                except ValueError:
                    self.fail(
                        f"200 with a body that is not JSON: {text[:1000]!r}", case, fatal=False
                    )


def test_fuzz_every_endpoint(tiny_server: ServerProcess) -> None:
    fuzzer = Fuzzer(tiny_server)
    run = given(case=all_cases())(fuzzer.run)
    if FULL:
        seed = int(os.environ.get("FLOWLLM_RELIABILITY_SEED") or random.randrange(2**32))
        print(f"\nfuzz seed: {seed} (FLOWLLM_RELIABILITY_SEED={seed} repeats this run)")
        run = hypothesis.seed(seed)(run)
    started = time.monotonic()
    try:
        SETTINGS(run)()
    finally:
        fuzzer.close()
    duration = time.monotonic() - started
    cases = sum(fuzzer.statuses.values())
    state = wait_for_no_leftovers(tiny_server.url, 2.0)
    report(
        "fuzz",
        {
            "cases": cases,
            "seconds": round(duration, 1),
            "statuses": dict(sorted(fuzzer.statuses.items())),
            "kinds": dict(sorted(fuzzer.kinds.items())),
            "slowest_case_seconds": round(fuzzer.slowest[0], 2),
            "slowest_case": fuzzer.slowest[1],
            "leftovers": state.nonzero,
        },
    )
    if fuzzer.problems:
        listing = "\n\n".join(
            f"=== {kind} ({fuzzer.problem_counts[kind]} cases); the first:\n{message}"
            for kind, message in fuzzer.problems.items()
        )
        raise AssertionError(
            f"{len(fuzzer.problems)} kinds of wrong answers in {cases} cases:\n\n{listing}"
        )
    assert state.clean, f"per-request state left 2 s after {cases} fuzz cases: {state.nonzero}"
    assert cases >= CASES * 0.95, f"only {cases} cases ran"


def test_metrics_expose_the_leftover_gauges(tiny_server: ServerProcess) -> None:
    """Every gauge the leak checks read is exported: KV usage, running and waiting
    sequences, open mailboxes, and live sequences for schedule, execute, sample and
    detokenize."""
    leftovers(tiny_server.url)  # fails naming any gauge /metrics lacks
