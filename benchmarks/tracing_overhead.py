"""What OpenTelemetry tracing costs serving: `flowllm bench serve` against the bundled
model served with tracing off, with `--otlp-traces-endpoint` (exporting over OTLP/HTTP to a
receiver that decodes every span), and optionally the same from another checkout (the code
before tracing existed, to show tracing off is unchanged). One server at a time, the
variants alternated round by round, in one run.

    .venv/bin/python benchmarks/tracing_overhead.py                       # 2 rounds
    .venv/bin/python benchmarks/tracing_overhead.py --baseline ../main    # with the old code
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "observability"))

from otlp_receiver import OtlpReceiver  # noqa: E402 - from the tests, by path


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve(checkout: Path, flags: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "flowllm", "serve", "--port", str(port),
             "--log-level", "warning", *flags],
            cwd=checkout, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server failed:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


def bench(args: argparse.Namespace, url: str, result: Path) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "flowllm", "bench", "serve", "--base-url", url,
        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--seed", "0", "--result-file", str(result), "--disable-tqdm",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench serve failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return json.loads(result.read_text())["metrics"]  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--baseline", type=Path, help="another checkout, served with tracing off")
    args = ap.parse_args()
    receiver = OtlpReceiver()
    variants: dict[str, tuple[Path, list[str]]] = {
        "tracing off": (REPO, []),
        "tracing on": (REPO, ["--otlp-traces-endpoint", receiver.url]),
    }
    if args.baseline is not None:
        variants["baseline"] = (args.baseline.resolve(), [])
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name, (checkout, flags) in variants.items():
                spans_before = len(receiver.spans)
                process, url = serve(checkout, flags, Path(tmp) / "server.log")
                try:
                    metrics = bench(args, url, Path(tmp) / "result.json")
                finally:
                    process.terminate()
                    process.wait(timeout=60)
                metrics["spans"] = len(receiver.spans) - spans_before
                rows[name].append(metrics)
                print(
                    f"round {round_ + 1} {name:12s} {metrics['output_throughput']:7.1f} tok/s  "
                    f"median TTFT {metrics['ttft']['median_ms']:7.1f} ms  "
                    f"median TPOT {metrics['tpot']['median_ms']:6.1f} ms  "
                    f"completed {metrics['completed']}  spans {metrics['spans']}",
                    flush=True,
                )
    off = statistics.mean(m["output_throughput"] for m in rows["tracing off"])
    for name, runs in rows.items():
        mean = statistics.mean(m["output_throughput"] for m in runs)
        print(f"{name:12s} mean {mean:7.1f} tok/s  ({mean / off:.3f} of tracing off)")
    receiver.close()


if __name__ == "__main__":
    main()
