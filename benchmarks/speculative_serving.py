"""Speculative decoding over HTTP: flowllm's n-gram prompt lookup against llama.cpp's server
with its own lookup decoding, on the bundled model's Q4_1 GGUF file, each with and without.

The grounded workload of `speculative.py` (chat prompts that give a passage of
`--passage-tokens` tokens and ask to repeat or lightly rewrite it), greedy, one request
at a time, streamed. Four servers, all started first and kept up (an idle one takes no
CPU), the modes run in turn `--pairs` times so that the machine's other load falls on each
alike:

- `flowllm`: `flowllm serve FILE` (weights served quantized, the default);
- `flowllm-ngram`: the same with `--speculative-config` method ngram (its defaults: up to
  4 drafts from n-grams of 2 to 4 tokens);
- `llama-server`: `llama-server -m FILE`, one slot;
- `llama-server-ngram`: the same with `--spec-type ngram-simple` (its defaults, or
  `--llama-spec-args`);
- `flowllm-before`, `flowllm-ngram-before`: flowllm's two modes run from another checkout
  (`--before DIR`), for a change's before and after measured in one run.

`--modes` picks which run (llama-server's only need `--llama-server`).

Per request, the time per output token after the first is (last chunk - first chunk) /
(completion tokens - 1), the tokens counted by the server's usage; the table gives the
mean over the requests. Beside it, the weight-reading floor: the file's bytes over the
machine's read bandwidth (a sum over a 1 GiB tensor, every thread, measured before each
pair: it varies on a shared machine), the time one token takes when every weight is read
once per token. Greedy texts must be equal with and without speculation, server by
server. `--num-speculative-tokens` sets flowllm's drafts per step (k, 4 by default).

    .venv/bin/python benchmarks/speculative_serving.py \
        --llama-server /path/to/llama-server
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from serve_comparison import (
    BEFORE,
    Server,
    before_checkout,
    bundled_gguf,
    bundled_model_dir,
    free_port,
)
from speculative import conversations, passages

MODES = ("flowllm", "flowllm-ngram", "llama-server", "llama-server-ngram")
NGRAM_SUFFIX = "-ngram"
NGRAM = {"method": "ngram", "disable_by_batch_size": None}


def without_lookup(mode: str) -> str:
    """The mode `mode` is measured against: itself without lookup."""
    before = mode.endswith(BEFORE)
    return mode.removesuffix(BEFORE).removesuffix(NGRAM_SUFFIX) + (BEFORE if before else "")


def command(args: argparse.Namespace, mode: str, port: int) -> list[str]:
    mode = mode.removesuffix(BEFORE)
    gguf = str(args.gguf)
    if mode.startswith("flowllm"):
        cmd = [
            sys.executable, "-m", "flowllm", "serve", gguf, "--served-model-name", "model",
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len",
            str(args.max_model_len), "--log-level", "warning",
        ]  # fmt: skip
        if mode == "flowllm-ngram":
            ngram = {**NGRAM, "num_speculative_tokens": args.num_speculative_tokens}
            cmd += ["--speculative-config", json.dumps(ngram)]
        return cmd
    cmd = [
        args.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", "1",
        "-c", str(args.max_model_len), "--log-disable", *args.llama_server_args.split(),
    ]  # fmt: skip
    if mode == "llama-server-ngram":
        cmd += ["--spec-type", "ngram-simple", *args.llama_spec_args.split()]
    return cmd


def stream_one(url: str, chat: list[dict[str, str]], max_tokens: int) -> tuple[str, int, float]:
    """One streamed greedy chat request: (its text, completion tokens, ms per output token
    after the first)."""
    body = {
        "model": "model", "messages": chat, "max_tokens": max_tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    text, tokens, first, last = [], 0, 0.0, 0.0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: {response.status_code} {response.read()[:500]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", ()):
                if choice.get("delta", {}).get("content"):
                    last = time.perf_counter()
                    first = first or last
                    text.append(choice["delta"]["content"])
    if tokens < 2:
        raise RuntimeError(f"{url}: {tokens} completion tokens")
    return "".join(text), tokens, (last - first) / (tokens - 1) * 1000


def read_bandwidth() -> float:
    """Bytes per second a sum over 1 GiB of float32 reads, best of 5."""
    data = torch.ones(2**28)
    data.sum()
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.numel() * 4 / best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", help="the llama-server binary (for its modes)")
    ap.add_argument("--llama-server-args", default="--no-repack", help="flags for both")
    ap.add_argument("--llama-spec-args", default="", help="more flags for its ngram mode")
    ap.add_argument("--gguf", type=Path, help="GGUF file (default: the bundled Q4_1 file)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--passage-tokens", type=int, default=500)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--modes", default=",".join(MODES), help="which run, in order")
    ap.add_argument("--num-speculative-tokens", type=int, default=4, help="flowllm's k")
    ap.add_argument("--before", type=Path, help="another checkout, for the `-before` modes")
    args = ap.parse_args()
    args.gguf = args.gguf or bundled_gguf()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted({m.removesuffix(BEFORE) for m in modes} - set(MODES))
    if unknown:
        ap.error(f"unknown modes {unknown}; choose from {MODES}, each also with {BEFORE}")
    if any(m.startswith("llama") for m in modes) and not args.llama_server:
        ap.error("llama-server's modes need --llama-server PATH to its binary")

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bundled_model_dir())
    chats = conversations(passages(tokenizer, args.prompts, args.passage_tokens))
    floors: list[float] = []  # ms, measured before each pair: the bandwidth varies
    servers: dict[str, tuple[Server, str]] = {}
    results: dict[str, list[float]] = {mode: [] for mode in modes}
    texts: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for mode in modes:
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                env = dict(os.environ)
                cwd = before_checkout(mode, args.before, env)
                server = Server(mode, command(args, mode, port), env,
                                Path(tmp) / f"{mode}.log", cwd)  # fmt: skip
                servers[mode] = (server, url)
                server.wait_healthy(url, args.startup_timeout)
                stream_one(url, chats[0], 8)  # warm-up
            for pair in range(args.pairs):
                floors.append(args.gguf.stat().st_size / read_bandwidth() * 1000)
                for mode in modes if pair % 2 == 0 else modes[::-1]:
                    url = servers[mode][1]
                    done = [stream_one(url, chat, args.max_tokens) for chat in chats]
                    results[mode].append(statistics.fmean(ms for _, _, ms in done))
                    texts[mode] = [text for text, _, _ in done]
                    print(f"pair {pair + 1} {mode}: {results[mode][-1]:.2f} ms/token, "
                          f"{sum(n for _, n, _ in done)} tokens", flush=True)  # fmt: skip
        finally:
            for server, _ in servers.values():
                server.stop()
    for mode in modes:
        base = without_lookup(mode)
        if base != mode and base in texts:
            same = sum(a == b for a, b in zip(texts[base], texts[mode], strict=True))
            print(f"{mode}: {same} of {len(chats)} greedy texts equal to {base}'s")
    print(f"\nweight-reading floor, before each pair: "
          f"{', '.join(f'{ms:.2f}' for ms in floors)} ms per token "
          f"({args.gguf.stat().st_size / 2**20:.0f} MiB)\n")  # fmt: skip
    print("| server | ms per output token, each pair | lookup / without |")
    print("|---|---|---:|")
    for mode in modes:
        base = without_lookup(mode)
        ratio = ""
        if base in results:
            ratio = f"{statistics.fmean(results[mode]) / statistics.fmean(results[base]):.2f}"
        runs = ", ".join(f"{ms:.2f}" for ms in results[mode])
        print(f"| {mode} | {runs} | {ratio} |")
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
