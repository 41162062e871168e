"""Graph overhead per step: the default graph with a model that answers instantly.

Everything but the model forward runs for real — ingest, validate, tokenize (GPT-2
tokenizer), the scheduler with its block pool, input building, the sampler (greedy, or the
parameters `--sampling` names), the incremental detokenizer, deliver and the mailboxes — so
the time per step is what the graph adds around a model step. Run:

    .venv/bin/python benchmarks/pipeline_overhead.py [--vocab 1024] [--steps 64] [--repeats 3]
        [--sampling greedy|random|seeded|everything] [--multiprocess]

`--multiprocess` runs the graph as a server places it: the step loop and the instant model
in an engine core process, the per-request stages, detokenize and deliver in this one
(`LLM(multiprocess=True)`). The metrics the columns read are then the front's: tpot and
the stage columns of detokenize and deliver; the core's stages show "-". cpu and faults
count both processes.

`--stage-bench` instead drives the step path's objects (scheduler, execute's runner, the
sampler, the scheduler's apply, detokenize and deliver) one after another on one thread,
torch on one intra-op thread, and prints each one's median CPU µs per decode step (a
figure that moves far less with the machine's load than the graph's wall time) and its
mean, which counts the steps where the sequences gain KV blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import mmap
import multiprocessing
import os
import resource
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from model_fixtures import write_gpt2_tokenizer_files

from flowllm.config import EngineConfig, engine_config
from flowllm.graph.stage import NoParams
from flowllm.llm import LLM
from flowllm.messages import SamplingParams, StepLogits, TokenizedRequest
from flowllm.models.tokenizer import load_tokenizer
from flowllm.stages.deliver import Deliver
from flowllm.stages.detokenize import Detokenize
from flowllm.stages.execute import Execute
from flowllm.stages.sample import Sample
from flowllm.stages.schedule import Schedule, ScheduleParams
from flowllm.stages.services import EngineServices, already_loaded


class ForwardLog:
    """(perf_counter, sampling rows) of every forward since the last `clear()`. With `path`
    they are kept in a file that both processes map, so that a model in another process
    can log them without a system call per forward, which would count as the step's time
    (both processes read the machine's monotonic clock). Entry 0 holds the count."""

    CAPACITY = 1 << 16  # forwards one run may log
    _ENTRY = struct.Struct("<dd")

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        size = (self.CAPACITY + 1) * self._ENTRY.size
        self._buffer: bytearray | mmap.mmap
        if path is None:
            self._buffer = bytearray(size)
            return
        with open(path, "a+b") as f:  # the first of the two processes makes it
            if os.fstat(f.fileno()).st_size < size:
                f.truncate(size)
            self._buffer = mmap.mmap(f.fileno(), size)

    def _count(self) -> int:
        return int(self._ENTRY.unpack_from(self._buffer, 0)[0])

    def add(self, rows: int) -> None:
        now = time.perf_counter()
        n = self._count() + 1
        if n > self.CAPACITY:
            raise RuntimeError(f"more than {self.CAPACITY} forwards in one run")
        self._ENTRY.pack_into(self._buffer, n * self._ENTRY.size, now, rows)
        self._ENTRY.pack_into(self._buffer, 0, n, 0)

    def clear(self) -> None:
        """Start a new run (while no forward runs: the model's process writes the count)."""
        self._ENTRY.pack_into(self._buffer, 0, 0, 0)

    def entries(self) -> list[tuple[float, int]]:
        entries = self._ENTRY.iter_unpack(self._buffer[: (self._count() + 1) * self._ENTRY.size])
        next(entries)  # the count
        return [(t, int(n)) for t, n in entries]


class InstantModel:
    """Returns the same logits row for every sampled position, at once.

    By default the rows are a view of one persistent tensor (the greedy sampler only reads
    them). `fresh`: a new tensor each call, written once, as a real model's LM head
    allocates its output (in execute's worker thread). `model_seconds`: each forward waits
    that long without holding the interpreter, as a step on a GPU does, so that what the
    host does meanwhile shows. `forwards`: where each forward is logged.
    """

    def __init__(
        self,
        vocab_size: int,
        fresh: bool = False,
        model_seconds: float = 0.0,
        forwards: ForwardLog | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.fresh = fresh
        self.model_seconds = model_seconds
        generator = torch.Generator().manual_seed(0)
        self._row = torch.randn(vocab_size, generator=generator)
        self._logits = self._row.expand(1024, vocab_size).contiguous()
        self.forwards = forwards or ForwardLog()

    def embed(self, input_ids: Any, positions: Any) -> torch.Tensor:
        return input_ids

    def forward_layers(self, h: Any, positions: Any, kv_caches: Any, ctx: Any) -> tuple[()]:
        if self.model_seconds:
            time.sleep(self.model_seconds)  # the device busy, the interpreter free
        return ()

    def compute_logits(self, hidden: Any, ctx: Any) -> torch.Tensor:
        self.forwards.add(len(ctx.logits_indices))
        rows = self._logits[: len(ctx.logits_indices)]  # [rows, vocab]
        return rows.clone() if self.fresh else rows


def bench_config(tokenizer_dir: str | None = None) -> EngineConfig:
    """The engine settings of every run (`tokenizer_dir`: where a front loads the tokenizer
    from, when the model is in another process)."""
    return engine_config(
        "instant",
        max_model_len=4096,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        tokenizer=tokenizer_dir,
    )


def services(
    vocab_size: int,
    tokenizer: Any,
    fresh_logits: bool = False,
    model_seconds: float = 0.0,
    config: EngineConfig | None = None,
    forwards: ForwardLog | None = None,
) -> EngineServices:
    return EngineServices(
        config=config or bench_config(),
        model=InstantModel(vocab_size, fresh_logits, model_seconds, forwards),
        tokenizer_loader=already_loaded(tokenizer),
        kv_caches=[],
        num_blocks=256 * 64,
        max_model_len=4096,
        eos_token_ids=(50256,),
        device=torch.device("cpu"),
        model_threads=torch.get_num_threads(),  # as a loaded model's services have them
    )


def core_services(
    vocab_size: int,
    tokenizer_dir: str,
    fresh_logits: bool,
    model_seconds: float,
    forwards_path: str,
    config: EngineConfig,
    tokenizer_now: bool = False,
) -> EngineServices:
    """An engine core process's services: the instant model, its forwards logged to
    `forwards_path` (`LLM(multiprocess=True, core_services=...)` calls it there)."""
    tokenizer = load_tokenizer(tokenizer_dir)
    log = ForwardLog(forwards_path)
    return services(vocab_size, tokenizer, fresh_logits, model_seconds, config, log)


STAGES = ("schedule", "execute", "sample", "detokenize", "deliver")
ASYNC_GRAPH = Path(__file__).resolve().parents[1] / "examples" / "graphs" / "async-scheduling.yaml"

# --sampling: each request's parameters (i: its index) besides max_tokens and ignore_eos
SAMPLING: dict[str, Callable[[int], dict[str, Any]]] = {
    "greedy": lambda i: {"temperature": 0.0},
    "random": lambda i: {"temperature": 0.8},
    "seeded": lambda i: {"temperature": 0.8, "seed": i},
    "everything": lambda i: {  # seeded, truncated, penalized, biased, with logprobs
        "temperature": 0.8,
        "top_k": 50,
        "top_p": 0.95,
        "seed": i,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.3,
        "repetition_penalty": 1.1,
        "logit_bias": {5: 1.0},
        "logprobs": 2,
    },
}


def graph_file(name: str) -> Path | None:
    """`default` (None: the LLM's own) or `async`: examples/graphs/async-scheduling.yaml,
    two steps in flight."""
    if name == "default":
        return None
    if name != "async":
        raise SystemExit(f"unknown graph {name!r}: default or async")
    return ASYNC_GRAPH


def sampling_params(kind: str, i: int, max_tokens: int) -> SamplingParams:
    """Request i's parameters under `--sampling kind`."""
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **SAMPLING[kind](i))


def cpu_and_faults() -> tuple[float, int]:
    """User + system CPU seconds and minor page faults of this process and its running
    children (an engine core), every thread."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu, faults = usage.ru_utime + usage.ru_stime, usage.ru_minflt
    tick = os.sysconf("SC_CLK_TCK")
    for child in multiprocessing.active_children():
        # /proc/PID/stat after the name: state is field 3, so minflt 10, utime 14, stime 15
        fields = Path(f"/proc/{child.pid}/stat").read_text().rpartition(")")[2].split()
        cpu += (int(fields[11]) + int(fields[12])) / tick
        faults += int(fields[7])
    return cpu, faults


class Run(NamedTuple):
    """One generate over `num_seqs` prompts."""

    seconds: float
    cpu_seconds: float
    minor_faults: int
    steps: int
    busy: dict[str, float | None]  # busy seconds per stage (None: not in this process)
    # mean time from one forward of every sequence to the next (None: no two such forwards
    # followed each other, the requests admitted over so many steps that they never all ran)
    step_seconds: float | None
    tpot_seconds: float | None  # the engine's mean time per output token (None: unknown)


def run(llm: LLM, forwards: ForwardLog, num_seqs: int, steps: int, sampling: str = "greedy") -> Run:
    """Time one generate of `steps` tokens for each of `num_seqs` prompts."""
    vocab = llm.services.logits_size  # prompt ids must be in the vocabulary
    prompts = [[(i * 7 + k) % vocab for k in range(16)] for i in range(num_seqs)]
    params = [sampling_params(sampling, i, steps) for i in range(num_seqs)]
    forwards.clear()
    cpu_started, faults_started = cpu_and_faults()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    cpu, faults = cpu_and_faults()
    assert all(len(o.outputs[0].token_ids) == steps for o in outputs)
    assert llm.last_run is not None
    registry = llm.last_run.registry
    count = registry.get_sample_value("flowllm:stage_duration_seconds_count", {"stage": "execute"})
    busy = {
        stage: registry.get_sample_value("flowllm:stage_duration_seconds_sum", {"stage": stage})
        for stage in STAGES
    }
    tpot_sum = registry.get_sample_value("flowllm:time_per_output_token_seconds_sum")
    tpot_count = registry.get_sample_value("flowllm:time_per_output_token_seconds_count")
    return Run(
        elapsed,
        cpu - cpu_started,
        faults - faults_started,
        int(count or 0),
        busy,
        full_batch_interval(forwards.entries(), num_seqs),
        tpot_sum / tpot_count if tpot_sum is not None and tpot_count else None,
    )


def full_batch_interval(forwards: list[tuple[float, int]], num_seqs: int) -> float | None:
    """The mean time between consecutive forwards that both sample every sequence: a step
    of the graph with all of them running, whenever the requests were admitted."""
    gaps = [b[0] - a[0] for a, b in pairwise(forwards) if a[1] == b[1] == num_seqs]
    return sum(gaps) / len(gaps) if gaps else None


class _Outbox:
    """Stands in for a stage context: keeps what a stage emits, by port."""

    def __init__(self) -> None:
        self.sent: dict[str, list[Any]] = {}

    async def emit(self, port: str, message: Any) -> None:
        self.sent.setdefault(port, []).append(message)


PARTS = ("schedule", "execute", "sample", "apply", "detokenize", "deliver")


async def stage_bench(
    svc: EngineServices, num_seqs: int, steps: int, sampling: str = "greedy"
) -> dict[str, tuple[float, float]]:
    """(median, mean) CPU seconds per decode step of each step-path part, after 8 warm-up
    steps. The mean counts the steps where every sequence gains a block (one in the block
    size, all at once here: they start together), which the median leaves out."""
    scheduler = Schedule(ScheduleParams(), svc).scheduler
    execute, sample = Execute(NoParams(), svc), Sample(NoParams(), svc)
    detokenize, deliver = Detokenize(NoParams(), svc), Deliver(NoParams(), svc)
    boxes = []
    for i in range(num_seqs):
        boxes.append(svc.mailboxes.open(f"r{i}", 1, time.monotonic()))
        prompt = tuple((i * 7 + k) % svc.model.vocab_size for k in range(16))
        scheduler.add_request(
            TokenizedRequest(
                request_id=f"r{i}",
                prompt_token_ids=prompt,
                params=sampling_params(sampling, i, steps + 9),
                eos_token_ids=svc.eos_token_ids,
                arrival_time=0.0,
            )
        )
    times: dict[str, list[float]] = {part: [] for part in PARTS}
    clock = time.thread_time
    for step in range(steps + 9):  # the first step is the prefill
        ctx = _Outbox()
        t0 = clock()
        batch = scheduler.schedule()
        events = scheduler.choice_events()
        t1 = clock()
        if batch is None:
            raise RuntimeError("the scheduler ran out of work")
        logits, prompt_logits = execute.runner.run(batch.rows)
        t2 = clock()
        step_logits = StepLogits(batch=batch, logits=logits, prompt_logits=prompt_logits)
        tokens = sample._sample(step_logits, None)
        t3 = clock()
        scheduler.apply(tokens)
        t4 = clock()
        if events is not None:
            await detokenize.handle(events, ctx)  # type: ignore[arg-type]
        await detokenize.handle(tokens, ctx)  # type: ignore[arg-type]
        t5 = clock()
        for message in ctx.sent.get("out", ()):
            await deliver.handle(message, ctx)  # type: ignore[arg-type]
        t6 = clock()
        for box in boxes:  # a reader keeping up, outside the timing
            while box._pending:
                await box.__anext__()
        if step >= 9:
            spans = (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)
            for part, d in zip(PARTS, spans, strict=True):
                times[part].append(d)
    return {part: (sorted(ts)[len(ts) // 2], sum(ts) / len(ts)) for part, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--fresh-logits",
        action="store_true",
        help="the model returns a newly allocated logits tensor each step, as a real one does",
    )
    parser.add_argument(
        "--sampling",
        choices=sorted(SAMPLING),
        default="greedy",
        help="the requests' sampling parameters (default: greedy)",
    )
    parser.add_argument(
        "--model-ms",
        type=float,
        default=0.0,
        help="each forward waits this long without the interpreter, as a GPU step does",
    )
    parser.add_argument(
        "--graphs",
        default="default",
        help="comma-separated: default, async (examples/graphs/async-scheduling.yaml: two "
        "steps in flight); several run alternately",
    )
    parser.add_argument(
        "--multiprocess",
        action="store_true",
        help="the step loop and the model in an engine core process, as a server runs them",
    )
    parser.add_argument(
        "--stage-bench",
        action="store_true",
        help="median CPU µs per step of each step-path part, driven on one thread",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        write_gpt2_tokenizer_files(Path(tmp))
        tokenizer = load_tokenizer(tmp)
        if args.stage_bench:
            print_stage_bench(args, tokenizer)
        else:
            compare_graphs(args, tokenizer, tmp)


def print_stage_bench(args: argparse.Namespace, tokenizer: Any) -> None:
    torch.set_num_threads(1)
    print(f"vocab {args.vocab}, {args.sampling}, CPU µs per decode step, one thread: "
          "median / mean")  # fmt: skip
    print(f"{'running seqs':>12}" + "".join(f"{p:>11}" for p in PARTS) + f"{'total':>11}")
    for num_seqs in (1, 64, 256):
        svc = services(args.vocab, tokenizer, args.fresh_logits)
        parts = asyncio.run(stage_bench(svc, num_seqs, args.steps, args.sampling))
        for label, i in (("", 0), ("mean", 1)):
            cols = "".join(f"{parts[p][i] * 1e6:>11.0f}" for p in PARTS)
            total = sum(t[i] for t in parts.values()) * 1e6
            print(f"{label or num_seqs:>12}{cols}{total:>11.0f}")


def open_llm(
    args: argparse.Namespace, tokenizer: Any, tokenizer_dir: str, graph: str
) -> tuple[LLM, ForwardLog]:
    """An LLM over the instant model, in this process or (`--multiprocess`) in a core."""
    model_seconds = args.model_ms / 1e3
    if not args.multiprocess:
        svc = services(args.vocab, tokenizer, args.fresh_logits, model_seconds)
        return LLM(services=svc, graph=graph_file(graph)), svc.model.forwards
    forwards = ForwardLog(str(Path(tokenizer_dir) / f"forwards-{graph}.txt"))
    build = functools.partial(
        core_services, args.vocab, tokenizer_dir, args.fresh_logits, model_seconds, forwards.path
    )
    llm = LLM(
        config=bench_config(tokenizer_dir),
        graph=graph_file(graph),
        multiprocess=True,
        core_services=build,
    )
    return llm, forwards


def compare_graphs(args: argparse.Namespace, tokenizer: Any, tokenizer_dir: str) -> None:
    llms = {name: open_llm(args, tokenizer, tokenizer_dir, name) for name in args.graphs.split(",")}
    try:
        print_runs(args, llms)
    finally:
        for llm, _ in llms.values():
            llm.close()


def print_runs(args: argparse.Namespace, llms: dict[str, tuple[LLM, ForwardLog]]) -> None:
    for llm, forwards in llms.values():
        run(llm, forwards, 4, 4, args.sampling)  # warm up
    k = args.steps
    fresh = ", fresh logits each step" if args.fresh_logits else ""
    model = f"a model of {args.model_ms:g} ms" if args.model_ms else "instant model"
    where = ", the core in its own process" if args.multiprocess else ""
    print(f"vocab {args.vocab}, {k} tokens per sequence, {args.sampling}, {model}{fresh}{where};")
    print(f"best of {args.repeats} runs. µs/step: the mean time from one forward that samples")
    print("every sequence to the next (all of them running; intake and prefill excluded); tpot:")
    print("the engine's own mean time per output token (flowllm:time_per_output_token_seconds),")
    print("lower than µs/step when requests were admitted over several steps, since they then")
    print("decode partly beside fewer others (- : in no run did every sequence run at once).")
    print("Round columns: the whole run per round (every")
    print("sequence gains one token), intake and prefill included; cpu: the CPU time of this")
    print("process and its engine core, if any (all threads), steadier than wall time on a")
    print("shared machine; faults: minor page faults; stage columns: busy µs per round from")
    print("each stage's duration histogram")
    print("(execute and sample include waiting for the GIL in their worker thread).")
    head = "".join(f"{s:>11}" for s in STAGES)
    print(
        f"{'graph':>9}{'running seqs':>13} {'µs/step':>8} {'tpot µs':>8} {'µs/round':>9} "
        f"{'cpu µs/round':>13} {'faults/round':>13}{head}"
    )
    for num_seqs in (1, 64, 256):
        runs: dict[str, list[Run]] = {name: [] for name in llms}
        for _ in range(args.repeats):
            for name, (llm, forwards) in llms.items():
                runs[name].append(run(llm, forwards, num_seqs, k, args.sampling))
        for name, done in runs.items():
            full = [r for r in done if r.step_seconds is not None]
            best = min(full or done, key=lambda r: r.step_seconds or r.tpot_seconds or r.seconds)
            step = _micros(best.step_seconds)
            cpu = min(r.cpu_seconds for r in done)
            faults = min(r.minor_faults for r in done)
            stages = "".join(f"{_micros(best.busy[s], k):>11}" for s in STAGES)
            print(
                f"{name:>9}{num_seqs:>13} {step:>8} {_micros(best.tpot_seconds):>8} "
                f"{best.seconds / k * 1e6:>9.0f} {cpu / k * 1e6:>13.0f} {faults / k:>13.0f}"
                f"{stages}"
            )


def _micros(seconds: float | None, per: int = 1) -> str:
    """`seconds / per` in µs, or "-" when not measured."""
    return "-" if seconds is None else f"{seconds / per * 1e6:.0f}"


if __name__ == "__main__":
    main()
