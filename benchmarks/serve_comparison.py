"""flowllm vs `transformers serve` or llama.cpp's `llama-server`: `flowllm bench serve`
against each, in one run.

The servers serve the same model (by default the bundled SmolLM2-135M-Instruct: its
HF-format directory converted once into the flowllm cache, or its Q4_1 GGUF file) on
127.0.0.1. For each server and each concurrency the script runs
`python -m flowllm bench serve` on the chat endpoint with the same random prompts (exact
token lengths from the model's tokenizer, the same seed) and keeps its JSON result; at the
end it prints one Markdown table of every server.

Servers (`--servers`, in order):
  - `flowllm`: the HF-format directory in `--dtype` (the dequantized model);
  - `flowllm-avx2`: the same in float32 with `FLOWLLM_NATIVE_ISA=avx2`, as a CPU without
    AVX-512 serves it (`--dtype auto` picks float32 there: it has no bf16 product);
  - `flowllm-q4`: the GGUF file, weights served quantized (`--dtype auto`: bf16
    activations where the CPU has AVX512-BF16);
  - `flowllm-q4-avx2`: the same with `FLOWLLM_NATIVE_ISA=avx2`, the AVX2 build of the
    kernels (what a CPU without AVX-512 runs, float32 activations as there);
  - `llama-server`: the GGUF file, by the binary given with `--llama-server` (built e.g.
    from the llama.cpp sources vendored in the llama-cpp-python sdist), one slot per
    concurrent request;
  - `transformers`: `transformers serve` on the HF-format directory;
  - any flowllm server's name with `-before` (`flowllm-q4-before`): the same server run
    from another checkout of flowllm (`--before DIR`), for a change's before and after
    measured in one run.
With `--interleave` every server is started first and kept up, and the concurrencies run
one after another across all of them (idle servers take no CPU), so that the machine's
other load falls on every server alike; otherwise each server runs alone in turn.

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
SERVERS = (
    "flowllm",
    "flowllm-avx2",
    "flowllm-q4",
    "flowllm-q4-avx2",
    "llama-server",
    "transformers",
)
AVX2_SERVERS = {"flowllm-avx2": "flowllm", "flowllm-q4-avx2": "flowllm-q4"}  # -> AVX-512 twin
GGUF_SERVERS = frozenset({"flowllm-q4", "flowllm-q4-avx2", "llama-server"})
BEFORE = "-before"  # a flowllm server run from the checkout given with --before
# transformers serve's continuous-batching cache sized for this model and these lengths: on
# CPU its default sizing made each decode step several times slower here.
TRANSFORMERS_ARGS = "--cb-num-blocks 512 --cb-block-size 32 --cb-max-batch-tokens 1024"


class ComparisonError(RuntimeError):
    """A server did not come up or a benchmark run failed; the message says which."""


def free_port() -> int:
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

    def __init__(
        self, name: str, cmd: Sequence[str], env: dict[str, str], log: Path, cwd: Path = REPO
    ) -> None:
        self.name = name
        self.log = log
        self._log_file = log.open("wb")
        self.proc = subprocess.Popen(
            list(cmd), env=env, stdout=self._log_file, stderr=subprocess.STDOUT, cwd=cwd
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


def bundled_model_dir() -> Path:
    sys.path.insert(0, str(REPO))
    from flowllm.models.bundled import ensure_bundled_model, find_bundled_model

    found = find_bundled_model()
    return found if found is not None else ensure_bundled_model()


def bundled_gguf() -> Path:
    sys.path.insert(0, str(REPO))
    from flowllm.models.bundled import bundled_gguf_path

    return bundled_gguf_path()


def before_checkout(name: str, before: Path | None, env: dict[str, str]) -> Path:
    """Where server `name` runs from: this checkout, or for a `-before` name the checkout
    `before`, which `env` then imports flowllm from."""
    if not name.endswith(BEFORE):
        return REPO
    if before is None:
        raise ComparisonError(f"{name} runs another checkout: give it with --before DIR")
    env["PYTHONPATH"] = str(before)
    return before


def _server_command(args: argparse.Namespace, name: str, port: int) -> list[str]:
    name = name.removesuffix(BEFORE)
    if name.startswith("flowllm"):
        quantized = name in GGUF_SERVERS
        model = args.gguf if quantized else args.model_dir
        return [
            sys.executable, "-m", "flowllm", "serve", str(model),
            "--served-model-name", str(args.model_dir),
            "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "auto" if quantized else "float32" if name == "flowllm-avx2" else args.dtype,
            "--max-model-len", str(args.max_model_len), "--kv-cache-memory", args.kv_cache_memory,
            "--log-level", "warning",
        ]  # fmt: skip
    if name == "llama-server":
        slots = max(args.concurrency)
        return [
            args.llama_server, "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(slots), "-c", str(slots * args.max_model_len), "--log-disable",
            *args.llama_server_args.split(),
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


def start(args: argparse.Namespace, name: str, out_dir: Path) -> tuple[Server, str]:
    """Start `name` and wait until it answers; (the server, its URL)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    if name == "transformers":
        hub_cache = out_dir / "hf-hub-cache"  # must exist; nothing is downloaded into it
        hub_cache.mkdir(exist_ok=True)
        env.update(HF_HUB_CACHE=str(hub_cache), HF_HUB_OFFLINE="1")
    if name.removesuffix(BEFORE) in AVX2_SERVERS:
        env["FLOWLLM_NATIVE_ISA"] = "avx2"
    cwd = before_checkout(name, args.before, env)
    server = Server(name, _server_command(args, name, port), env, out_dir / f"{name}.log", cwd)
    try:
        server.wait_healthy(url, args.startup_timeout)
        _warm_up(url, str(args.model_dir))
    except BaseException:
        server.stop()
        raise
    return server, url


def run_server(args: argparse.Namespace, name: str, out_dir: Path) -> dict[int, dict[str, Any]]:
    """Start `name`, benchmark it at every concurrency, stop it; results by concurrency."""
    server, url = start(args, name, out_dir)
    results: dict[int, dict[str, Any]] = {}
    try:
        for concurrency in args.concurrency:
            print(f"== {name}, concurrency {concurrency}", flush=True)
            result = out_dir / f"{name}-c{concurrency}.json"
            results[concurrency] = _bench(args, name, url, concurrency, result)
    finally:
        server.stop()
    return results


def run_interleaved(
    args: argparse.Namespace, names: Sequence[str], out_dir: Path
) -> dict[str, dict[int, dict[str, Any]]]:
    """Every server up at once; each concurrency run against each server in turn."""
    servers: dict[str, tuple[Server, str]] = {}
    results: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in names}
    try:
        for name in names:
            servers[name] = start(args, name, out_dir)
        for concurrency in args.concurrency:
            for name in names:
                print(f"== {name}, concurrency {concurrency}", flush=True)
                result = out_dir / f"{name}-c{concurrency}.json"
                url = servers[name][1]
                results[name][concurrency] = _bench(args, name, url, concurrency, result)
    finally:
        for server, _ in servers.values():
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
        for name, by_concurrency in results.items():
            if concurrency in by_concurrency:
                lines.append(_row(name, concurrency, by_concurrency[concurrency]))
    for avx2, avx512 in AVX2_SERVERS.items():
        ratios = []
        for concurrency in concurrencies:
            try:
                a = results[avx2][concurrency]["metrics"]["tpot"].get("median_ms")
                b = results[avx512][concurrency]["metrics"]["tpot"].get("median_ms")
            except KeyError:
                continue
            if a and b:
                ratios.append(f"concurrency {concurrency}: {a / b:.2f}x")
        if ratios:
            lines.append("")
            lines.append(f"{avx2} / {avx512} median TPOT: " + ", ".join(ratios))
    pairs = [(ours, peer) for ours in ("flowllm", "flowllm-avx2", "flowllm-q4", "flowllm-q4-avx2")
             for peer in ("transformers", "llama-server")]  # fmt: skip
    pairs += [(name.removesuffix(BEFORE), name) for name in results if name.endswith(BEFORE)]
    for ours_name, peer in pairs:
        ratios = []
        for concurrency in concurrencies:
            try:
                ours = results[ours_name][concurrency]["metrics"]
                theirs = results[peer][concurrency]["metrics"]
            except KeyError:
                continue
            if theirs["output_throughput"] > 0:
                tpot = ""
                a, b = ours["tpot"].get("median_ms"), theirs["tpot"].get("median_ms")
                if a and b:
                    tpot = f" (TPOT {a / b:.2f}x)"
                ratio = ours["output_throughput"] / theirs["output_throughput"]
                ratios.append(f"concurrency {concurrency}: {ratio:.2f}x{tpot}")
        if ratios:
            lines.append("")
            lines.append(f"{ours_name} / {peer} output throughput: " + ", ".join(ratios))
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
    ap.add_argument("--gguf", type=Path, help="GGUF file (default: the bundled Q4_1 file)")
    ap.add_argument("--llama-server", help="the llama-server binary (for `llama-server`)")
    ap.add_argument("--llama-server-args", default="", help="extra llama-server flags (-t 1)")
    ap.add_argument("--interleave", action="store_true", help="all servers up, runs interleaved")
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
    ap.add_argument("--before", type=Path, help="another checkout, for the `-before` servers")
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.model_dir is None:
        args.model_dir = bundled_model_dir()
    args.model_dir = args.model_dir.resolve()
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = sorted({s.removesuffix(BEFORE) for s in servers} - set(SERVERS))
    if unknown:
        ap.error(f"unknown servers {unknown}; choose from {SERVERS}")
    if "transformers" in servers and not Path(args.transformers).is_file():
        ap.error(f"no transformers CLI at {args.transformers!r}; see this script's docstring")
    if "llama-server" in servers and not (args.llama_server and Path(args.llama_server).is_file()):
        ap.error("llama-server needs --llama-server PATH to its binary")
    if args.gguf is None:
        args.gguf = bundled_gguf()
    args.gguf = args.gguf.resolve()
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="serve-comparison-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"model {args.model_dir}, dtype {args.dtype}, results in {out_dir}", flush=True)

    results: dict[str, dict[int, dict[str, Any]]] = {}
    try:
        if args.interleave:
            results = run_interleaved(args, servers, out_dir)
        else:
            for name in servers:
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
