"""Embeddings: `flowllm serve` (/v1/embeddings, concurrent clients) against
sentence-transformers' `encode` on the same CPU, the same BERT and the same texts.

The model is a random BERT of a small embedder's shape (bge-small-en-v1.5's by default: 12
layers, hidden 384, 12 heads, MLP 1536, [CLS] pooling, normalized), built by
tests/embedding_fixtures.py with its own WordPiece vocabulary (of a few hundred tokens:
the vocabulary changes only the embedding table, never the products). Every text is
`--tokens` tokens long, [CLS] and [SEP] included, by construction (one vocabulary word a
token).

- flowllm: `python -m flowllm serve MODEL --dtype D` as a user starts it (an engine core
  and a front process), `--concurrency` clients each posting one text per request, back
  to back, `--requests` in all per round;
- sentence-transformers: `SentenceTransformer(MODEL).encode(texts, batch_size=B)` in this
  process on the same `--requests` texts, its best case (a whole batch at once, no HTTP),
  in float32 as it loads the model, and optionally in bf16 (`--st-bf16`).

The servers stay up; each round runs every contender once, one after another, so the
machine's other load falls on all of them alike, and the table gives each one's median
and best throughput (texts/s) with the load average around the rounds. Run:

    .venv/bin/python benchmarks/embeddings.py --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from embedding_fixtures import WORDS, build_bert_dir  # noqa: E402
from server_process import ServerProcess  # noqa: E402


def texts_of(count: int, tokens: int) -> list[str]:
    """`count` texts of exactly `tokens` tokens each ([CLS] + words + [SEP]), all distinct."""
    words = [w for w in WORDS if w.isalpha()]
    return [
        " ".join(words[(i * 7 + j * 13) % len(words)] for j in range(tokens - 2))
        for i in range(count)
    ]


async def _post_all(url: str, model: str, texts: list[str], concurrency: int) -> float:
    """Seconds to embed `texts` with `concurrency` clients, one text per request."""
    queue = list(enumerate(texts))
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def worker() -> None:
            while queue:
                _, text = queue.pop()
                response = await client.post(
                    "/v1/embeddings", json={"model": model, "input": text}
                )
                response.raise_for_status()

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start


def flowllm_round(server: ServerProcess, texts: list[str], concurrency: int) -> float:
    return asyncio.run(_post_all(server.url, server.model, texts, concurrency))


def st_round(encode: Callable[[list[str]], object], texts: list[str]) -> float:
    start = time.perf_counter()
    encode(texts)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per text")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=256, help="texts per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtypes", default="auto,float32", help="flowllm --dtype values")
    parser.add_argument("--st-batch-size", type=int, default=32)
    parser.add_argument("--st-bf16", action="store_true", help="also sentence-transformers in bf16")
    args = parser.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    folder = Path(tempfile.mkdtemp(prefix="flowllm-embed-bench-"))
    model = build_bert_dir(
        folder / "bert", num_hidden_layers=args.layers, hidden_size=args.hidden,
        num_attention_heads=args.heads, intermediate_size=args.intermediate,
        max_position_embeddings=512,
    )  # fmt: skip
    texts = texts_of(args.requests, args.tokens)
    st32 = SentenceTransformer(str(model), device="cpu", local_files_only=True)
    assert len(st32.tokenizer(texts[0])["input_ids"]) == args.tokens
    contenders: dict[str, Callable[[], float]] = {
        "sentence-transformers float32": lambda: st_round(
            lambda t: st32.encode(t, batch_size=args.st_batch_size), texts
        ),
    }
    if args.st_bf16:
        st16 = SentenceTransformer(str(model), device="cpu", local_files_only=True)
        st16.to(torch.bfloat16)
        contenders["sentence-transformers bfloat16"] = lambda: st_round(
            lambda t: st16.encode(t, batch_size=args.st_batch_size), texts
        )
    servers = []
    try:
        for dtype in args.dtypes.split(","):
            server = ServerProcess(str(model), ["--dtype", dtype, "--disable-uvicorn-access-log"])
            servers.append(server.wait_healthy())
            contenders[f"flowllm --dtype {dtype}"] = lambda s=server: flowllm_round(
                s, texts, args.concurrency
            )
        for run in contenders.values():  # warm up: kernels built, first steps planned
            run()
        times: dict[str, list[float]] = {name: [] for name in contenders}
        loads = [os.getloadavg()[0]]
        for _ in range(args.rounds):
            for name, run in contenders.items():
                times[name].append(run())
            loads.append(os.getloadavg()[0])
    finally:
        for server in servers:
            server.stop()
    baseline = times["sentence-transformers float32"]
    print(
        f"\nBERT {args.layers} layers x {args.hidden} ({args.heads} heads, MLP "
        f"{args.intermediate}), {args.requests} texts of {args.tokens} tokens, flowllm at "
        f"{args.concurrency} concurrent requests, sentence-transformers batch "
        f"{args.st_batch_size}, {args.rounds} rounds; load average "
        f"{min(loads):.2f}-{max(loads):.2f} on {os.cpu_count()} CPUs\n"
    )
    print("| contender | texts/s median | texts/s best | vs sentence-transformers fp32 |")
    print("|---|---|---|---|")
    for name, seconds in times.items():
        median = statistics.median(seconds)
        # each round's ratio, the two having run back to back: the load they shared cancels
        ratio = statistics.median(b / s for b, s in zip(baseline, seconds, strict=True))
        print(
            f"| {name} | {args.requests / median:.1f} | {args.requests / min(seconds):.1f} | "
            f"{ratio:.2f}x |"
        )


if __name__ == "__main__":
    main()
