"""CPU time of the scheduler's two calls per decode step, `schedule` and `apply`, by the
number of running sequences, with the running part of a step taken as columns and one by
one (`Scheduler.columns_from`).

Every sequence has a 32-token prompt and decodes in lockstep with the others (a greedy
step's tokens fed straight back), in blocks of 16 with prefix caching on, as the default
graph runs them. Each figure is the median over the decode steps (the mean, which counts
the steps where sequences fill or gain a block, beside it), the best of `--repeats` runs.
The process keeps its freed heap mapped, as the engine's runner does, so that page faults
of a heap given back and taken again do not read as the scheduler's time.

    .venv/bin/python benchmarks/scheduler_step.py [--seqs 1,4,8,12,16,32,64,256]
        [--steps 160] [--repeats 3]

The `default` column is what a scheduler does as built (`COLUMNS_FROM` decides); the two
others force one way, which shows where the columns' fixed cost is paid back. Run against
an older tree (`PYTHONPATH`), whose scheduler has no columns, it prints `default` alone:
the before of a before-and-after.
"""

from __future__ import annotations

import argparse
import statistics
import time

from flowllm.config import CacheConfig, SchedulerConfig
from flowllm.messages import SampledTokens, SamplingParams, StepTokens, TokenizedRequest
from flowllm.models import glibc_heap
from flowllm.scheduling import scheduler as scheduler_module
from flowllm.scheduling.scheduler import Scheduler

PROMPT = 32
COLUMNS_FROM: int | None = getattr(scheduler_module, "COLUMNS_FROM", None)
WAYS: dict[str, int | None] = (
    {"default": None}
    if COLUMNS_FROM is None
    else {"default": None, "columns": 1, "one by one": 1 << 30}
)


def decode_steps(
    num_seqs: int, steps: int, columns_from: int | None
) -> tuple[list[int], list[int]]:
    """CPU ns of each decode step's `schedule` and `apply` (the first two steps, which
    admit and prefill, left out); `columns_from` None leaves the scheduler's own."""
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=max(num_seqs, 1), max_num_batched_tokens=8192),
        CacheConfig(block_size=16, enable_prefix_caching=True),
        num_blocks=num_seqs * (PROMPT + steps) // 16 + 2 * num_seqs + 16,
        max_model_len=PROMPT + steps + 16,
    )
    if columns_from is not None:
        sched.columns_from = columns_from
    for i in range(num_seqs):
        sched.add_request(
            TokenizedRequest(
                request_id=f"r{i}",
                prompt_token_ids=tuple(range(i * PROMPT + 1, (i + 1) * PROMPT + 1)),
                params=SamplingParams(max_tokens=steps + 8),
                eos_token_ids=(0,),
                arrival_time=0.0,
            )
        )
    schedule_ns: list[int] = []
    apply_ns: list[int] = []
    clock = time.process_time_ns
    for step in range(steps):
        t0 = clock()
        batch = sched.schedule()
        t1 = clock()
        if batch is None:
            raise RuntimeError("the sequences ended before the steps did")
        rows = batch.rows
        seq_ids = tuple(s for s, sample in zip(rows.seq_ids, rows.sample, strict=True) if sample)
        tokens = StepTokens(
            step_id=batch.step_id,
            sampled=SampledTokens(
                seq_ids=seq_ids,
                token_ids=tuple(1 + (step + i) % 50 for i in range(len(seq_ids))),
                finishes={},
                logprobs=(),
            ),
        )
        t2 = clock()
        sched.apply(tokens)
        t3 = clock()
        if step >= 2:
            schedule_ns.append(t1 - t0)
            apply_ns.append(t3 - t2)
    return schedule_ns, apply_ns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="1,4,8,12,16,32,64,256")
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    glibc_heap.keep_freed_memory_mapped()
    print(
        "µs of CPU per decode step, schedule + apply, median (mean); "
        + (f"columns from {COLUMNS_FROM} running sequences by default" if COLUMNS_FROM else "")
    )
    print(f"{'seqs':>6}" + "".join(f"{way:>24}" for way in WAYS))
    for num_seqs in (int(s) for s in args.seqs.split(",")):
        cells = []
        for columns_from in WAYS.values():
            runs = [decode_steps(num_seqs, args.steps, columns_from) for _ in range(args.repeats)]
            median = min(statistics.median(s) + statistics.median(a) for s, a in runs) / 1e3
            mean = min(statistics.mean(s) + statistics.mean(a) for s, a in runs) / 1e3
            cells.append(f"{median:.1f} ({mean:.1f})")
        print(f"{num_seqs:>6}" + "".join(f"{cell:>24}" for cell in cells))


if __name__ == "__main__":
    main()
