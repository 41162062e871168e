"""Serving efficiency: one engine's output tok/s offline and over HTTP, alternately in one run.

The same model, engine settings and workload both ways: `--num-prompts` random prompts of
`--input-len` tokens (exact lengths by the model's tokenizer, built by
`flowllm.bench.prompts`, the code `flowllm bench serve` uses, with the same seed), greedy,
`--output-len` tokens each with `ignore_eos`, prefix caching off in both (the server would
otherwise find every run's prompts cached by its earlier runs; the offline engine starts
each `generate` with an empty cache).

- offline: `flowllm.llm.LLM(...).generate(all prompts)` in this process; output tokens
  over the call's wall time. With `--matched-offline`, also one more `LLM` per concurrency
  c below the number of prompts, its `max_num_seqs` set to c: the engine holding c
  sequences at once, as the server does at concurrency c, so that serving/matched is the
  cost of the HTTP path alone and not of a smaller batch.
- serving: one `python -m flowllm serve` subprocess, started once (healthy on `/health`)
  and kept up; each measurement is a `python -m flowllm bench serve` subprocess at one
  `--concurrency`, streamed completions; its output tok/s.

Only the CLI, HTTP and `LLM` are used, so the benchmark runs the same whether the server
is one process or several. Rounds alternate the order (offline first in odd rounds,
serving first in even ones) so that a drift in the machine's load falls on both; one
small warm-up of each comes first. The table gives each round's rates and serving/offline.

    .venv/bin/python benchmarks/serving_efficiency.py                     # bundled, 2 rounds
    .venv/bin/python benchmarks/serving_efficiency.py --model tiny-gpt2 --num-prompts 32
    .venv/bin/python benchmarks/serving_efficiency.py --server-arg=--api-server-count \\
        --server-arg=2                                                     # server-only flags
    python benchmarks/serving_efficiency.py --device cuda --model tiny-gpt2 --gpt2-shape 124m
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from flowllm.bench.prompts import Prompt, load_tokenizer, random_prompts
from flowllm.bench.serve import read_result_file

REPO = Path(__file__).resolve().parents[1]
# The shapes `--gpt2-shape` builds (flowllm.models.random_gpt2.build_gpt2_dir's sizes):
# the tests' tiny one, and GPT-2 124M (the builder's defaults).
GPT2_SHAPES: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 4},
    "124m": {},
}
# On CUDA every engine shares one GPU, each with its own share of the device's memory
# (`gpu_memory_utilization`): the server this one, the offline engines (the matched ones
# too) the second, split evenly among them.
SERVER_GPU_SHARE = 0.35
OFFLINE_GPU_SHARE = 0.55
WARMUP_PROMPTS = 16
WARMUP_TOKENS = 8


class BenchmarkError(RuntimeError):
    """A run went wrong (the server did not start, a client run failed)."""


@dataclass
class Round:
    """One round: the offline rate and the serving rate at each concurrency (output tok/s)."""

    index: int
    order: str  # "offline first" or "serving first"
    offline_tok_s: float = 0.0
    offline_s: float = 0.0
    offline_tokens: int = 0
    serving_tok_s: dict[int, float] = field(default_factory=dict)
    serving_failed: dict[int, int] = field(default_factory=dict)
    serving_tokens: dict[int, int] = field(default_factory=dict)
    # offline with max_num_seqs = c (--matched-offline), by concurrency c
    matched_tok_s: dict[int, float] = field(default_factory=dict)
    matched_tokens: dict[int, int] = field(default_factory=dict)
    load_avg: float = 0.0  # 1-minute load average when the round ended

    def ratio(self, concurrency: int) -> float:
        return self.serving_tok_s[concurrency] / self.offline_tok_s

    def matched_ratio(self, concurrency: int) -> float:
        """Serving at c against offline holding c sequences at once (all at once when
        c covers every prompt)."""
        offline = self.matched_tok_s.get(concurrency, self.offline_tok_s)
        return self.serving_tok_s[concurrency] / offline


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the subprocesses: this checkout first on the path."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


class Server:
    """`python -m flowllm serve`, in this process's group: a `timeout` or Ctrl-C that
    stops the benchmark reaches it too; processes it starts are its own to stop."""

    def __init__(self, model: str | None, flags: list[str], env: dict[str, str], log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        command = [
            sys.executable, "-m", "flowllm", "serve", *([model] if model else []),
            "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning", *flags,
        ]  # fmt: skip
        self.command = command
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                command,
                cwd=REPO,
                env=child_env(env),
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def wait_healthy(self, timeout: float) -> float:
        """Seconds until `/health` answered 200; raises with the server's log otherwise."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.process.poll() is not None:
                raise BenchmarkError(
                    f"flowllm serve exited with {self.process.returncode}:\n{self.tail()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise BenchmarkError(f"flowllm serve not healthy after {timeout:.0f} s:\n{self.tail()}")

    def stop(self, grace: float = 15.0) -> int | None:
        """SIGTERM (a graceful drain, the server stopping what it started), then SIGKILL."""
        if self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(grace)
        if self.process.poll() is None:
            self.process.kill()
        return self.process.wait()


def serve_has_flag(flag: str) -> bool:
    """Whether this checkout's `flowllm serve` takes `flag` (read from its --help)."""
    done = subprocess.run(
        [sys.executable, "-m", "flowllm", "serve", "--help"],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return flag in done.stdout


def resolve_model(args: argparse.Namespace, scratch: Path) -> tuple[str | None, str | None]:
    """(the model argument of `serve` and `LLM`, None for the bundled default; the
    tokenizer directory the prompts are built with, None for random-word prompts)."""
    if args.model == "bundled":
        from flowllm.models.bundled import ensure_bundled_model

        return None, str(ensure_bundled_model())
    if args.model == "tiny-gpt2":
        from flowllm.models.random_gpt2 import build_gpt2_dir

        path = build_gpt2_dir(scratch / f"gpt2-{args.gpt2_shape}", **GPT2_SHAPES[args.gpt2_shape])
        return str(path), str(path)
    path = Path(args.model).expanduser()
    has_tokenizer = path.is_dir() and (path / "tokenizer_config.json").is_file()
    return args.model, str(path) if has_tokenizer else None


def engine_settings(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """The settings both engines share: as `LLM` keywords and as `serve` flags."""
    settings: dict[str, Any] = {"dtype": args.dtype}
    if args.quantization is not None:
        settings["quantization"] = args.quantization
    if args.max_num_seqs is not None:
        settings["max_num_seqs"] = args.max_num_seqs
    flags: list[str] = []
    for key, value in settings.items():
        flags += ["--" + key.replace("_", "-"), str(value)]
    # The server keeps its prefix cache across runs, the offline engine starts each
    # generate with an empty one: with it on, every run after the server's first would
    # skip the prefill of prompts it has seen.
    settings["enable_prefix_caching"] = args.prefix_caching
    flags.append("--enable-prefix-caching" if args.prefix_caching else "--no-enable-prefix-caching")
    return settings, flags


def bench_serve(
    url: str,
    args: argparse.Namespace,
    *,
    num_prompts: int,
    output_len: int,
    concurrency: int,
    tokenizer: str | None,
    result: Path,
) -> tuple[float, int, int]:
    """(output tok/s, failed requests, output tokens) of one `flowllm bench serve` run."""
    command = [
        sys.executable, "-m", "flowllm", "bench", "serve", "--base-url", url,
        "--num-prompts", str(num_prompts), "--random-input-len", str(args.input_len),
        "--random-output-len", str(output_len), "--max-concurrency", str(concurrency),
        "--seed", str(args.seed), "--extra-body", '{"temperature": 0}', "--disable-tqdm",
        "--request-timeout", str(args.request_timeout), "--result-file", str(result),
        *(["--tokenizer", tokenizer] if tokenizer else []),
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=REPO, env=child_env(), capture_output=True, text=True, check=False
    )
    if done.returncode != 0 or not result.is_file():
        raise BenchmarkError(
            f"flowllm bench serve exited with {done.returncode}:\n"
            f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        )
    metrics = read_result_file(result).metrics
    return metrics.output_throughput, metrics.failed, metrics.total_output_tokens


def offline_run(llm: Any, prompts: list[Prompt], output_len: int) -> tuple[float, int]:
    """(seconds, output tokens) of one `LLM.generate` over every prompt at once."""
    from flowllm.messages import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    texts = [p.text for p in prompts]
    started = time.perf_counter()
    outputs = llm.generate(texts, params)
    elapsed = time.perf_counter() - started
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def build_llm(
    model: str | None, settings: dict[str, Any], args: argparse.Namespace, engines: int
) -> Any:
    """One of `engines` offline engines; `multiprocess` is passed only when asked for."""
    from flowllm.llm import LLM

    kwargs = dict(settings)
    if args.device == "cuda":
        kwargs.update(device="cuda", gpu_memory_utilization=OFFLINE_GPU_SHARE / engines)
    else:
        kwargs["device"] = "cpu"
    if args.offline_multiprocess:
        kwargs["multiprocess"] = True
    return LLM(model, **kwargs)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(rounds: list[Round], concurrencies: list[int], matched: list[int]) -> str:
    """The table as Markdown (it pastes into benchmarks/README.md), with a median row; with
    matched offline runs, their rates and serving against them too."""
    head = "| round | order | offline tok/s |"
    rule = "|---|---|---:|"
    for c in concurrencies:
        head += f" serving c={c} tok/s | c={c} / offline |"
        rule += "---:|---:|"
        if c in matched:
            head += f" offline max_num_seqs={c} tok/s | c={c} / matched |"
            rule += "---:|---:|"
    lines = [head + " load |", rule + "---:|"]
    for r in rounds:
        line = f"| {r.index} | {r.order} | {r.offline_tok_s:.1f} |"
        for c in concurrencies:
            line += f" {r.serving_tok_s[c]:.1f} | {r.ratio(c):.2f} |"
            if c in matched:
                line += f" {r.matched_tok_s[c]:.1f} | {r.matched_ratio(c):.2f} |"
        lines.append(line + f" {r.load_avg:.1f} |")
    line = f"| median | | {median([r.offline_tok_s for r in rounds]):.1f} |"
    for c in concurrencies:
        rates = [r.serving_tok_s[c] for r in rounds]
        line += f" {median(rates):.1f} | {median([r.ratio(c) for r in rounds]):.2f} |"
        if c in matched:
            line += f" {median([r.matched_tok_s[c] for r in rounds]):.1f} |"
            line += f" {median([r.matched_ratio(c) for r in rounds]):.2f} |"
    lines.append(line + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--model",
        default="bundled",
        help="bundled (what `flowllm serve` serves by default), tiny-gpt2 (random weights, "
        "the real GPT-2 tokenizer; --gpt2-shape) or a model path (default: %(default)s)",
    )
    parser.add_argument("--gpt2-shape", choices=tuple(GPT2_SHAPES), default="tiny")
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="both engines' device (default: cuda where available, else cpu)",
    )
    parser.add_argument(
        "--dtype", default=None, help="both engines' dtype (default: bfloat16 on cuda, else auto)"
    )
    parser.add_argument("--quantization", default=None, help="both engines' --quantization")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="both engines'")
    parser.add_argument(
        "--prefix-caching",
        action="store_true",
        help="leave prefix caching on in both engines (off by default: the server would "
        "find the prompts of its earlier runs cached)",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[64, 256], help="serving concurrencies"
    )
    parser.add_argument("--seed", type=int, default=0, help="the prompts' seed")
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for `flowllm serve` only (repeat; write --server-arg=--flag)",
    )
    parser.add_argument(
        "--offline-multiprocess",
        action="store_true",
        help="pass multiprocess=True to LLM (only where LLM takes it)",
    )
    parser.add_argument(
        "--matched-offline",
        action="store_true",
        help="also run offline with max_num_seqs set to each concurrency below --num-prompts",
    )
    parser.add_argument(
        "--offline-threads",
        type=int,
        default=None,
        help="torch threads of the offline engine (default: torch's own, as LLM leaves it)",
    )
    parser.add_argument("--no-warmup", action="store_true", help="skip the warm-up runs")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds")
    parser.add_argument("--request-timeout", type=float, default=1200.0, help="seconds")
    parser.add_argument("--server-log", type=Path, help="keep the server's log here")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if min(args.rounds, args.num_prompts, args.input_len, args.output_len) < 1:
        parser.error("--rounds, --num-prompts, --input-len and --output-len must be >= 1")
    if min(args.concurrency) < 1:
        parser.error("--concurrency must be >= 1")
    if args.device == "auto":  # decided here: both engines must land on the same device
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "auto"
    if args.matched_offline and args.max_num_seqs is not None:
        parser.error("--matched-offline sets max_num_seqs itself; leave out --max-num-seqs")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (a `timeout`) unwinds like Ctrl-C, so the server is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    from flowllm.logging_config import configure_logging

    # The offline engine logs in this process: at warning, as the server is started.
    configure_logging(level=os.environ.get("FLOWLLM_LOG_LEVEL", "warning"), force=True)
    load_start = os.getloadavg()
    print(f"load average at start: {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}")
    with tempfile.TemporaryDirectory(prefix="serving-efficiency-") as tmp:
        scratch = Path(tmp)
        model, tokenizer_dir = resolve_model(args, scratch)
        settings, flags = engine_settings(args)
        server_env: dict[str, str] = {}
        if args.device == "cuda":
            flags += ["--gpu-memory-utilization", str(SERVER_GPU_SHARE)]
        if serve_has_flag("--device"):
            flags += ["--device", args.device]
        elif args.device == "cpu":
            server_env["CUDA_VISIBLE_DEVICES"] = ""  # `serve` has no --device: hide the GPU
        tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir else None
        prompts = random_prompts(
            args.num_prompts, args.input_len, args.output_len, seed=args.seed, tokenizer=tokenizer
        )
        prompt_tokens = sum(p.prompt_len for p in prompts)
        expected = args.num_prompts * args.output_len
        print(
            f"model {args.model} ({model or 'bundled'}), device {args.device}, {settings}; "
            f"{args.num_prompts} prompts, {prompt_tokens} prompt tokens, {args.output_len} "
            f"output tokens each",
            flush=True,
        )
        log = args.server_log or scratch / "server.log"
        server = Server(model, [*flags, *args.server_arg], server_env, log)
        print("server:", " ".join(server.command[1:]), flush=True)
        rounds: list[Round] = []
        matched = [c for c in args.concurrency if args.matched_offline and c < args.num_prompts]
        startup = float("nan")
        error: str | None = None
        try:
            startup = server.wait_healthy(args.startup_timeout)
            print(f"server healthy after {startup:.1f} s", flush=True)
            import torch

            if args.offline_threads is not None:
                torch.set_num_threads(args.offline_threads)
            print(f"offline torch threads: {torch.get_num_threads()}", flush=True)
            started = time.perf_counter()
            engines = 1 + len(matched)
            llm = build_llm(model, settings, args, engines)
            print(f"offline engine loaded in {time.perf_counter() - started:.1f} s", flush=True)
            matched_llms = {
                c: build_llm(model, {**settings, "max_num_seqs": c}, args, engines) for c in matched
            }

            if not args.no_warmup:
                few = prompts[:WARMUP_PROMPTS]
                for engine in (llm, *matched_llms.values()):
                    offline_run(engine, few, WARMUP_TOKENS)
                bench_serve(
                    server.url, args, num_prompts=len(few), output_len=WARMUP_TOKENS,
                    concurrency=len(few), tokenizer=tokenizer_dir, result=scratch / "warm.json",
                )  # fmt: skip
                print("warmed up", flush=True)

            for index in range(1, args.rounds + 1):
                offline_first = index % 2 == 1
                r = Round(index, "offline first" if offline_first else "serving first")
                steps = ["offline", "serving"] if offline_first else ["serving", "offline"]
                for step in steps:
                    if step == "offline":
                        seconds, tokens = offline_run(llm, prompts, args.output_len)
                        r.offline_s, r.offline_tokens = seconds, tokens
                        r.offline_tok_s = tokens / seconds
                        print(f"round {index} offline: {r.offline_tok_s:.1f} tok/s "
                              f"({tokens} tokens, {seconds:.1f} s)", flush=True)  # fmt: skip
                        for c, engine in matched_llms.items():
                            seconds, tokens = offline_run(engine, prompts, args.output_len)
                            r.matched_tok_s[c], r.matched_tokens[c] = tokens / seconds, tokens
                            print(f"round {index} offline max_num_seqs={c}: "
                                  f"{tokens / seconds:.1f} tok/s", flush=True)  # fmt: skip
                        continue
                    for c in args.concurrency:
                        rate, failed, tokens = bench_serve(
                            server.url, args, num_prompts=args.num_prompts,
                            output_len=args.output_len, concurrency=c, tokenizer=tokenizer_dir,
                            result=scratch / f"serve-{index}-{c}.json",
                        )  # fmt: skip
                        r.serving_tok_s[c], r.serving_failed[c] = rate, failed
                        r.serving_tokens[c] = tokens
                        print(f"round {index} serving c={c}: {rate:.1f} tok/s "
                              f"({tokens} tokens, {failed} failed)", flush=True)  # fmt: skip
                r.load_avg = os.getloadavg()[0]
                rounds.append(r)
        except Exception as exc:  # the rounds done so far are still reported
            error = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            print(f"--- the server's log, last lines:\n{server.tail()}", flush=True)
        finally:
            code = server.stop()
            print(f"server stopped (exit {code})", flush=True)

    short = [
        f"{kind} {got} of {expected}"
        for r in rounds
        for kind, got in [
            ("offline", r.offline_tokens),
            *r.serving_tokens.items(),
            *((f"offline max_num_seqs={c}", n) for c, n in r.matched_tokens.items()),
        ]
        if got != expected
    ]
    print()
    print(report(rounds, args.concurrency, matched))
    load_end = os.getloadavg()
    print(f"\nload average at end: {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}")
    if short:
        print("WARNING: output tokens short of the workload:", ", ".join(short))
    if error is not None:
        print(f"ERROR: {error}")
    if args.json is not None:
        figures = {
            "argv": sys.argv,
            "model": args.model,
            "gpt2_shape": args.gpt2_shape if args.model == "tiny-gpt2" else None,
            "device": args.device,
            "engine_settings": settings,
            "server_args": args.server_arg,
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "prompt_tokens": prompt_tokens,
            "concurrency": args.concurrency,
            "load_avg_start": load_start,
            "load_avg_end": load_end,
            "server_startup_s": startup,
            "error": error,
            "rounds": [asdict(r) for r in rounds],
            "median": {
                "offline_tok_s": median([r.offline_tok_s for r in rounds]),
                **{
                    f"serving_c{c}_tok_s": median([r.serving_tok_s[c] for r in rounds])
                    for c in args.concurrency
                },
                **{f"ratio_c{c}": median([r.ratio(c) for r in rounds]) for c in args.concurrency},
                **{
                    f"matched_ratio_c{c}": median([r.matched_ratio(c) for r in rounds])
                    for c in matched
                },
            },
        }
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
        print(f"figures written to {args.json}")
    failed = sum(sum(r.serving_failed.values()) for r in rounds)
    return 1 if failed or short or error else 0


if __name__ == "__main__":
    sys.exit(main())
