"""flowllm vs `transformers serve`: `flowllm bench serve` against both, in one run.

Both servers serve the same model files (by default the bundled SmolLM2-135M-Instruct,
converted once into the flowllm cache) in the same dtype, on 127.0.0.1, one at a time (the
machines have 2 cores). For each server and each concurrency the script runs
`python -m flowllm bench serve` on the chat endpoint with the same random prompts (exact
token lengths from the model's tokenizer, the same seed) and keeps its JSON result; at the
end it prints one Markdown table of both servers.

`transformers serve` comes from a separate virtualenv (its serving extra pins packages the
project's own environment must not get):

    python3 -m venv /tmp/tfserve
    /tmp/tfserve/bin/pip install torch==2.13.0
    /tmp/tfserve/bin/pip install 'transformers[serving]==5.23.0'
    .venv/bin/python benchmarks/serve_comparison.py --transformers /tmp/tfserve/bin/transformers

`transformers serve` rejects request fields it does not know, so its requests go without
`ignore_eos` (it may stop at EOS before `--output-len`; the table shows the mean output
length each server really produced), and its `model` field is the model directory's path.
It needs `--continuous-batching` for concurrent requests and an existing `HF_HUB_CACHE`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
SERVERS = ("flowllm", "transformers")
# transformers serve's continuous-batching cache sized for this model and these lengths: on
# CPU its default sizing made each decode step several times slower here.
TRANSFORMERS_ARGS = "--cb-num-blocks 512 --cb-block-size 32 --cb-max-batch-tokens 1024"


class ComparisonError(RuntimeError):
    """A server did not come up or a benchmark run failed; the message says which."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


class Server:
    """One server subprocess with its output in a log file."""

    def __init__(self, name: str, cmd: Sequence[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self.log = log
        self._log_file = log.open("wb")
        self.proc = subprocess.Popen(
            list(cmd), env=env, stdout=self._log_file, stderr=subprocess.STDOUT, cwd=REPO
        )

    def wait_healthy(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ComparisonError(
                    f"{self.name} exited with {self.proc.returncode}; see {self.log}:\n"
                    + self.log.read_text(errors="replace")[-3000:]
                )
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise ComparisonError(f"{self.name} not healthy after {timeout:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log_file.close()


def _bundled_model_dir() -> Path:
    sys.path.insert(0, str(REPO))
    from flowllm.models.bundled import ensure_bundled_model, find_bundled_model

    found = find_bundled_model()
    return found if found is not None else ensure_bundled_model()


def _server_command(args: argparse.Namespace, name: str, port: int) -> list[str]:
    if name == "flowllm":
        return [
            sys.executable, "-m", "flowllm", "serve", str(args.model_dir),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
            "--max-model-len", str(args.max_model_len), "--kv-cache-memory", args.kv_cache_memory,
            "--log-level", "warning",
        ]  # fmt: skip
    return [
        args.transformers, "serve", str(args.model_dir), "--continuous-batching",
        "--dtype", args.dtype, "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
        "--log-level", "warning", *args.transformers_args.split(),
    ]  # fmt: skip


def _warm_up(url: str, model: str) -> None:
    """One short streamed request, so the first measured one does not pay one-time costs.

    Streamed because `transformers serve --continuous-batching` drops the connection of a
    non-streamed chat request (seen with 5.23.0).
    """
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_completion_tokens": 8,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        text = response.read().decode(errors="replace")
    if response.status_code != 200 or "data:" not in text:
        raise ComparisonError(f"warm-up request failed: {response.status_code} {text[:500]}")


def _bench(
    args: argparse.Namespace, name: str, url: str, concurrency: int, result: Path
) -> dict[str, Any]:
    num_prompts = max(args.min_prompts, args.prompts_per_slot * concurrency)
    cmd = [
        sys.executable, "-m", "flowllm", "bench", "serve",
        "--base-url", url, "--endpoint", "chat", "--model", str(args.model_dir),
        "--tokenizer", str(args.model_dir),
        "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--seed", str(args.seed), "--result-file", str(result), "--disable-tqdm",
    ]  # fmt: skip
    if name == "transformers":
        cmd.append("--no-ignore-eos")  # it rejects unknown request fields
    load_before = _load_average()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    print(done.stdout, flush=True)
    if done.returncode != 0 or not result.is_file():
        raise ComparisonError(f"bench serve against {name} failed:\n{done.stderr[-3000:]}")
    data = json.loads(result.read_text())
    data["load_average"] = (load_before, _load_average())
    result.write_text(json.dumps(data, indent=2))
    return data  # type: ignore[no-any-return]


def run_server(args: argparse.Namespace, name: str, out_dir: Path) -> dict[int, dict[str, Any]]:
    """Start `name`, benchmark it at every concurrency, stop it; results by concurrency."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    if name == "transformers":
        hub_cache = out_dir / "hf-hub-cache"  # must exist; nothing is downloaded into it
        hub_cache.mkdir(exist_ok=True)
        env.update(HF_HUB_CACHE=str(hub_cache), HF_HUB_OFFLINE="1")
    server = Server(name, _server_command(args, name, port), env, out_dir / f"{name}.log")
    results: dict[int, dict[str, Any]] = {}
    try:
        server.wait_healthy(url, args.startup_timeout)
        _warm_up(url, str(args.model_dir))
        for concurrency in args.concurrency:
            print(f"== {name}, concurrency {concurrency}", flush=True)
            result = out_dir / f"{name}-c{concurrency}.json"
            results[concurrency] = _bench(args, name, url, concurrency, result)
    finally:
        server.stop()
    return results


def _row(name: str, concurrency: int, data: dict[str, Any]) -> str:
    m = data["metrics"]
    completed = m["completed"]
    mean_out = m["total_output_tokens"] / completed if completed else 0.0

    def ms(stats: dict[str, Any]) -> str:
        value = stats.get("median_ms")
        return "–" if value is None else f"{value:,.0f}"

    return (
        f"| {name} | {concurrency} | {completed}/{completed + m['failed']} | {mean_out:.0f} "
        f"| {m['output_throughput']:.1f} | {ms(m['ttft'])} | {ms(m['tpot'])} "
        f"| {ms(m['e2el'])} | {data['load_average'][0]:.1f} |"
    )


def table(results: dict[str, dict[int, dict[str, Any]]]) -> str:
    lines = [
        "| server | concurrency | completed | mean output tokens | output tok/s "
        "| median TTFT ms | median TPOT ms | median E2E ms | load avg |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    concurrencies = sorted({c for by_c in results.values() for c in by_c})
    for concurrency in concurrencies:
        for name in SERVERS:
            if concurrency in results.get(name, {}):
                lines.append(_row(name, concurrency, results[name][concurrency]))
    ratios = []
    for concurrency in concurrencies:
        try:
            ours = results["flowllm"][concurrency]["metrics"]["output_throughput"]
            theirs = results["transformers"][concurrency]["metrics"]["output_throughput"]
        except KeyError:
            continue
        if theirs > 0:
            ratios.append(f"concurrency {concurrency}: {ours / theirs:.2f}x")
    if ratios:
        lines.append("")
        lines.append("flowllm / transformers serve output throughput: " + ", ".join(ratios))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, help="HF-format model (default: bundled SmolLM2)")
    ap.add_argument(
        "--transformers",
        default=shutil.which("transformers") or "/tmp/tfserve/bin/transformers",
        help="the `transformers` CLI of the venv with transformers[serving]",
    )
    ap.add_argument(
        "--transformers-args",
        default=TRANSFORMERS_ARGS,
        help="extra `transformers serve` flags (default: %(default)s)",
    )
    ap.add_argument("--servers", default="flowllm,transformers", help="which to run, in order")
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prompts-per-slot", type=int, default=2, help="prompts = this x concurrency")
    ap.add_argument("--min-prompts", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--out-dir", type=Path, help="result JSON files (default: a temp dir)")
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.model_dir is None:
        args.model_dir = _bundled_model_dir()
    args.model_dir = args.model_dir.resolve()
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = sorted(set(servers) - set(SERVERS))
    if unknown:
        ap.error(f"unknown servers {unknown}; choose from {SERVERS}")
    if "transformers" in servers and not Path(args.transformers).is_file():
        ap.error(f"no transformers CLI at {args.transformers!r}; see this script's docstring")
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="serve-comparison-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"model {args.model_dir}, dtype {args.dtype}, results in {out_dir}", flush=True)

    results: dict[str, dict[int, dict[str, Any]]] = {}
    for name in servers:
        try:
            results[name] = run_server(args, name, out_dir)
        except ComparisonError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    report = table(results)
    (out_dir / "table.md").write_text(report + "\n")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
