"""What an open web page costs serving: throughput with the page closed and open, one run.

One `flowllm serve` (the bundled model unless --model), loaded once. Each round runs
`flowllm bench serve` once "closed" (no page) and once "open" (headless Chromium on the
graph view: the live feed sends a snapshot a second, the page redraws it, and the
request timelines record every span), closed first in odd rounds, open first in even
ones (`--bare-feed` adds "feed": a bare SSE client on the feed, no browser, which
separates the server's cost from the browser's CPU). The median output tok/s of each
variant and their ratio to "closed" are printed, after what the request timelines' span
sink costs per step message of 16 sequences.

    .venv/bin/python benchmarks/ui_overhead.py                      # SmolLM2, 3 rounds each
    .venv/bin/python benchmarks/ui_overhead.py --model DIR --rounds 2 --num-prompts 64

Needs Debian's chromium (`make setup`) and Playwright for Python (the dev extra).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import timeit
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from server_process import ServerProcess

from flowllm.bench.serve import read_result_file


@contextmanager
def open_page(url: str, chromium: str) -> Iterator[Any]:
    """The page on its graph view, following the live feed, until the body ends."""
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(url + "/")
            expect(page.locator("body")).to_have_attribute("data-ready", "true", timeout=60_000)
            page.click("#tab-graph")
            expect(page.locator("#feed-state")).to_have_class("feed-state on")
            yield page
        finally:
            browser.close()


@contextmanager
def follow_feed(url: str) -> Iterator[None]:
    """A bare SSE client on the live feed (no browser): the server's side of an open page."""
    import httpx

    stop = threading.Event()
    subscribed = threading.Event()

    def follow() -> None:
        with httpx.stream("GET", url + "/ui/feed", timeout=30) as response:
            for _line in response.iter_lines():
                subscribed.set()
                if stop.is_set():
                    return

    thread = threading.Thread(target=follow)
    thread.start()
    subscribed.wait(30)
    try:
        yield
    finally:
        stop.set()
        thread.join()


def sink_cost(batch: int = 16, number: int = 2000) -> dict[str, float]:
    """Microseconds the request timelines' sink takes per span of each step message."""
    from flowllm.messages import (
        Chunk,
        SampledToken,
        SampledTokens,
        SamplingParams,
        ScheduledRows,
        ScheduledSeq,
        SeqStart,
        StepBatch,
        StepTokens,
        TextDeltas,
    )
    from flowllm.ui.timelines import RequestTimelines

    sink = RequestTimelines(["stage"], "graph")
    starts = tuple(
        SeqStart(
            seq_id=i,
            request_id=f"r{i}",
            index=0,
            params=SamplingParams(),
            prompt_token_ids=(1,),
            eos_token_ids=(0,),
        )
        for i in range(batch)
    )
    sink("stage", StepBatch(step_id=0, rows=ScheduledRows.of(()), started=starts), 0.0, 0.0, 0.0)
    seqs = tuple(
        ScheduledSeq(
            seq_id=i,
            token_ids=(1,),
            num_computed_tokens=5,
            block_table=(1,),
            sample=True,
            num_output_tokens=1,
        )
        for i in range(batch)
    )
    messages = {
        "StepBatch": StepBatch(step_id=1, rows=ScheduledRows.of(seqs)),
        "StepTokens": StepTokens(
            step_id=1,
            sampled=SampledTokens.of(
                tuple(SampledToken(seq_id=i, token_id=1) for i in range(batch))
            ),
        ),
        "TextDeltas": TextDeltas(
            step_id=1,
            chunks=tuple(
                Chunk(request_id=f"r{i}", index=0, text="x", token_ids=(1,)) for i in range(batch)
            ),
        ),
    }
    costs = {}
    for name, message in messages.items():
        seconds = timeit.timeit(lambda m=message: sink("stage", m, 0.0, 0.0, 0.0), number=number)
        costs[name] = seconds / number * 1e6
    return costs


def bench(server: ServerProcess, args: argparse.Namespace, out: Path) -> tuple[float, int]:
    """(output tok/s, failed requests) of one `flowllm bench serve` run."""
    command = [
        sys.executable, "-m", "flowllm", "bench", "serve", "--base-url", server.url,
        "--num-prompts", str(args.num_prompts), "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--max-concurrency", str(args.concurrency),
        "--seed", "0", "--disable-tqdm", "--result-file", str(out),
    ]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    metrics = read_result_file(out).metrics
    return metrics.output_throughput, metrics.failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model to serve (default: the bundled SmolLM2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each variant")
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument(
        "--bare-feed",
        action="store_true",
        help="also run a third variant: a bare SSE client on the feed, no browser",
    )
    args = parser.parse_args()
    for name, us in sink_cost().items():
        print(f"timeline sink: {us:.1f} µs per {name} of 16 sequences")
    server = ServerProcess(args.model).wait_healthy(timeout=600)
    variants = ("closed", "open", "feed") if args.bare_feed else ("closed", "open")
    results: dict[str, list[float]] = {v: [] for v in variants}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            bench(server, args, Path(tmp) / "warmup.json")  # first steps pay for warm-up
            for round_ in range(args.rounds):
                order = variants if round_ % 2 == 0 else variants[::-1]
                for variant in order:
                    out = Path(tmp) / f"{variant}-{round_}.json"
                    if variant == "open":
                        with open_page(server.url, args.chromium):
                            tps, failed = bench(server, args, out)
                    elif variant == "feed":
                        with follow_feed(server.url):
                            tps, failed = bench(server, args, out)
                    else:
                        tps, failed = bench(server, args, out)
                    results[variant].append(tps)
                    print(f"round {round_ + 1} {variant:>6}: {tps:7.1f} output tok/s, "
                          f"{failed} failed", flush=True)  # fmt: skip
    finally:
        server.stop()
    closed = statistics.median(results["closed"])
    for variant in variants[1:]:
        median = statistics.median(results[variant])
        print(f"median closed {closed:.1f} tok/s, {variant} {median:.1f} tok/s: "
              f"{variant}/closed {median / closed:.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
