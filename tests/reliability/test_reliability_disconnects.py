"""A disconnect storm: streams cut by their clients at random points.

Raw sockets, 32 at a time, each a streaming completion or chat request cut in one of the
places a real client leaves: halfway through the request headers or the body, right
after the request (before the response headers), after the headers, after the first
token, mid-stream, and some left to finish as a control; half the cuts are a FIN, half a
RST. Within 2 s of the last cut no KV block, running or waiting sequence, request mailbox
or per-sequence state may remain, and the server's RSS (after a warm-up) may drift by less
than 25 MB. Both RSS readings follow the heap trim the idle server makes a second after
its last step (`flowllm:heap_trims_total`), which gives back what the steps freed: without
it the drift held whatever freed heap glibc kept, 0-30 MB. The core's threads share one
malloc arena from its start (`glibc_heap.one_arena`): while the threads it started before
loading the model kept arenas of their own, how each happened to fragment moved RSS by -7
to +26 MB a round of 1000 streams with nothing held; with one arena the storm's drift is
4-6 MB, then 1-2 MB a round (docs/reliability.md).

The warm-up is a round of cut streams, then enough long prompts to have used every block
of the KV cache once. The cache is a mapping whose pages become resident when first
written, and the block pool hands out the block freed longest ago, so traffic makes all of
it resident sooner or later: 64 MiB here (`TINY_FLAGS`), a bounded and known amount, more
than the drift allowed, which a round of short streams leaves mostly untouched. Filling it
first leaves the drift to what is not bounded by a budget.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import random
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from reliability_helpers import (
    HEAP_TRIMS,
    KV_USAGE,
    RUNNING,
    leftovers,
    report,
    rss_mb,
    scaled,
    scrape,
    wait_for_heap_trim,
    wait_for_no_leftovers,
)
from server_process import TINY_FLAGS, ServerProcess

from flowllm.config import CacheConfig
from flowllm.models.kv_cache import KVCacheSpec

STREAMS = scaled(1000, 10_000)
WARMUP = scaled(500, 2000)
CONCURRENCY = 32
STREAM_TIMEOUT = 60.0  # seconds one stream may take before it counts as a hang
RSS_DRIFT_MB = 25.0
CUTS = (
    "mid-headers",
    "mid-body",
    "before-response",
    "after-headers",
    "first-token",
    "mid-stream",
    "complete",
)


@dataclass(frozen=True)
class Stream:
    number: int
    path: str
    body: bytes
    cut: str
    events_before_cut: int  # for mid-stream
    reset: bool  # RST (SO_LINGER 0) instead of FIN

    def describe(self) -> str:
        how = "RST" if self.reset else "FIN"
        at = f" after {self.events_before_cut} events" if self.cut == "mid-stream" else ""
        body = self.body.decode()
        return f"stream {self.number}: POST {self.path} {body} cut {self.cut}{at} ({how})"


def make_stream(number: int, rng: random.Random) -> Stream:
    max_tokens = rng.choice((8, 32, 64))
    fields = {"stream": True, "max_tokens": max_tokens, "ignore_eos": True,
              "temperature": rng.choice((0.0, 1.0)), "n": rng.choice((1, 1, 1, 2))}  # fmt: skip
    if rng.random() < 0.5:
        path = "/v1/completions"
        body = {"prompt": f"Storm {number}: once upon a time", **fields}
    else:
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": f"Storm {number}"}], **fields}
    if rng.random() < 0.2:
        body["stream_options"] = {"include_usage": True}
    return Stream(
        number=number,
        path=path,
        body=json.dumps(body).encode(),
        cut=rng.choice(CUTS),
        events_before_cut=rng.randint(2, max_tokens),
        reset=rng.random() < 0.5,
    )


class StormError(AssertionError):
    pass


async def run_stream(port: int, stream: Stream) -> tuple[str, int | None]:
    """Play one stream; returns (what happened, the status if the headers were read)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = (
        f"POST {stream.path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(stream.body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode() + stream.body
    status: int | None = None
    outcome = stream.cut
    try:
        if stream.cut == "mid-headers":
            writer.write(request[: request.index(b"\r\n\r\n") // 2])
            await writer.drain()
            return outcome, None
        if stream.cut == "mid-body":
            writer.write(request[: len(request) - len(stream.body) // 2])
            await writer.drain()
            return outcome, None
        writer.write(request)
        await writer.drain()
        if stream.cut == "before-response":
            return outcome, None
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status != 200 or stream.cut == "after-headers":
            return (outcome if status == 200 else f"status {status}"), status
        wanted = {"first-token": 1, "mid-stream": stream.events_before_cut}.get(stream.cut)
        received = b""
        while True:
            chunk = await reader.read(65536)
            if not chunk:
                break
            received += chunk
            if wanted is not None and received.count(b"data: ") >= wanted:
                return outcome, status
        if b"data: [DONE]" not in received:
            raise StormError(f"stream ended without [DONE]: ...{received[-500:]!r}")
        return ("complete" if wanted is None else "finished before its cut"), status
    finally:
        if stream.reset:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def storm(server: ServerProcess, streams: list[Stream]) -> collections.Counter[str]:
    outcomes: collections.Counter[str] = collections.Counter()
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(stream: Stream) -> None:
        async with gate:
            try:
                outcome, status = await asyncio.wait_for(
                    run_stream(server.port, stream), STREAM_TIMEOUT
                )
            except TimeoutError:
                raise StormError(
                    f"no progress in {STREAM_TIMEOUT} s on {stream.describe()}\n"
                    f"server log:\n{server.output()[-3000:]}"
                ) from None
            except (ConnectionError, asyncio.IncompleteReadError) as exc:
                if server.process.poll() is not None:
                    raise StormError(
                        f"the server exited ({server.process.returncode}) during "
                        f"{stream.describe()}\nserver log:\n{server.output()[-3000:]}"
                    ) from exc
                outcome, status = f"connection error {type(exc).__name__}", None
            if status is not None and status >= 500:
                raise StormError(
                    f"status {status} for {stream.describe()}\n"
                    f"server log:\n{server.output()[-3000:]}"
                )
            outcomes[outcome] += 1

    await asyncio.gather(*(one(s) for s in streams))
    return outcomes


def kv_cache_blocks(model_dir: Path) -> int:
    """How many blocks the tiny server's KV cache has (its model, fp32, `TINY_FLAGS`)."""
    flags = dict(zip(TINY_FLAGS[::2], TINY_FLAGS[1::2], strict=True))
    assert flags["--dtype"] == "float32" and flags["--kv-cache-memory"] == "64MiB", flags
    config = json.loads((model_dir / "config.json").read_text())
    heads = config["n_head"]
    spec = KVCacheSpec(
        config["n_layer"], heads, config["n_embd"] // heads, torch.float32,
        CacheConfig().block_size,
    )  # fmt: skip
    return spec.num_blocks_for(64 * 2**20)


async def use_every_kv_block(server: ServerProcess, num_blocks: int) -> None:
    """Prompts of `--max-model-len` - 1 token ids, each starting with its own token (no
    prefix shared), generating one token: together they take every block once."""
    flags = dict(zip(TINY_FLAGS[::2], TINY_FLAGS[1::2], strict=True))
    prompt_len = int(flags["--max-model-len"]) - 1
    blocks_per_prompt = math.ceil(prompt_len / CacheConfig().block_size)  # the default size
    prompts = math.ceil(num_blocks / blocks_per_prompt)
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        prompt = [1 + i] + [(7 * k) % 50000 + 1 for k in range(prompt_len - 1)]
        async with gate:
            response = await client.post(
                "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60
            )
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] == prompt_len

    async with httpx.AsyncClient(base_url=server.url) as client:
        await asyncio.gather(*(one(client, i) for i in range(prompts)))


@pytest.mark.anyio
async def test_disconnect_storm_frees_everything(
    tiny_server: ServerProcess, gpt2_tiny_dir: Path
) -> None:
    rng = random.Random(20261125)
    pid = tiny_server.process.pid
    warmup = [make_stream(-i - 1, rng) for i in range(WARMUP)]
    trims = scrape(tiny_server.url).get(HEAP_TRIMS, 0.0)
    await storm(tiny_server, warmup)
    await use_every_kv_block(tiny_server, kv_cache_blocks(gpt2_tiny_dir))
    settled = await asyncio.to_thread(wait_for_no_leftovers, tiny_server.url, 10.0)
    assert settled.clean, f"state left after the warm-up round: {settled.nonzero}"
    trims = await asyncio.to_thread(wait_for_heap_trim, tiny_server.url, trims)
    rss_before = rss_mb(pid)

    streams = [make_stream(i, rng) for i in range(STREAMS)]
    peaks = {RUNNING: 0.0, KV_USAGE: 0.0}
    watching = asyncio.Event()

    async def watch() -> None:  # the check below is not vacuous: the storm does hold state
        while not watching.is_set():
            values = await asyncio.to_thread(scrape, tiny_server.url)
            for name in peaks:
                peaks[name] = max(peaks[name], values.get(name, 0.0))
            await asyncio.sleep(0.1)

    watcher = asyncio.create_task(watch())
    started = time.monotonic()
    outcomes = await storm(tiny_server, streams)
    duration = time.monotonic() - started
    watching.set()
    await watcher
    ended = time.monotonic()
    state = await asyncio.to_thread(wait_for_no_leftovers, tiny_server.url, 2.0)
    freed_after = time.monotonic() - ended
    await asyncio.to_thread(wait_for_heap_trim, tiny_server.url, trims)
    rss_after = rss_mb(pid)
    health = httpx.get(f"{tiny_server.url}/health", timeout=5).status_code
    report(
        "disconnect storm",
        {
            "streams": STREAMS,
            "warmup_streams": WARMUP,
            "concurrency": CONCURRENCY,
            "seconds": round(duration, 1),
            "outcomes": dict(sorted(outcomes.items())),
            "peak_running": peaks[RUNNING],
            "peak_kv_cache_usage": round(peaks[KV_USAGE], 4),
            "freed_after_seconds": round(freed_after, 2),
            "rss_before_mb": round(rss_before, 1),
            "rss_after_mb": round(rss_after, 1),
            "leftovers": state.nonzero,
        },
    )
    assert sum(outcomes.values()) == STREAMS
    assert peaks[RUNNING] > 0 and peaks[KV_USAGE] > 0, f"the storm never held state: {peaks}"
    assert state.clean, f"2 s after the storm's last cut, state is still held: {state.nonzero}"
    assert health == 200
    assert rss_after - rss_before < RSS_DRIFT_MB, (
        f"RSS went from {rss_before:.1f} to {rss_after:.1f} MB over {STREAMS} streams"
    )
    # And the server still answers completely.
    assert not leftovers(tiny_server.url).nonzero
    check = httpx.post(
        f"{tiny_server.url}/v1/completions",
        json={"prompt": "After the storm", "max_tokens": 4},
        timeout=30,
    )
    assert check.status_code == 200, check.text
