"""The scheduler driven by a simulated engine, checked against plain sequential generation.

The simulated model writes each scheduled token into a flat paged "KV cache" (one token id
per slot, addressed exactly as the execute stage does: block_table[p // block_size] *
block_size + p % block_size), then, for every row that samples, reads the whole context
back through the block table and picks the next token as a fixed function of it. If block
tables, prefix-cache reuse, same-step sibling sharing, chunking or recompute after
preemption ever mix up a block, the context read back differs from the sequence's tokens
and the test fails; at the end every sequence's output must equal what plain sequential
generation of its prompt gives.

With async scheduling the simulated model reads a placeholder row's token from the ids
sampled by the step it names, as execute does on the device, and the simulated sampler drops
the rows of sequences an earlier token ended, as sample does.
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from flowllm.config import CacheConfig, SchedulerConfig
from flowllm.messages import (
    PLACEHOLDER_TOKEN,
    FinishReason,
    SampledToken,
    SampledTokens,
    SamplingParams,
    StepBatch,
    StepTokens,
    TokenizedRequest,
)
from flowllm.scheduling.scheduler import Scheduler
from flowllm.scheduling.sequence import FinishedSeq
from flowllm.stopping import StopRule

NEVER = 10**9  # columns_from: every running sequence one by one
VOCAB = 13  # small, so EOS (0) and stop token ids come up often
EOS = 0
PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8, 9], [5, 5, 5, 5], [])


def next_token(index: int, context: list[int]) -> int:
    """The simulated model: a fixed function of the choice index and the whole context."""
    return hash((index, *context)) % VOCAB


def stop_check(
    params: SamplingParams, token: int, num_output: int, num_tokens: int, max_model_len: int
) -> tuple[FinishReason | None, int | None]:
    """The sample stage's finishing rule (the engine's own), used by the simulation and the
    reference alike."""
    return StopRule(params, (EOS,), num_tokens - num_output, max_model_len)(token, num_output)


def reference(
    prompt: tuple[int, ...], index: int, params: SamplingParams, max_model_len: int
) -> tuple[list[int], FinishReason]:
    """Plain sequential generation: the oracle."""
    tokens = list(prompt)
    out: list[int] = []
    while True:
        tok = next_token(index, tokens)
        tokens.append(tok)
        out.append(tok)
        reason, _ = stop_check(params, tok, len(out), len(tokens), max_model_len)
        if reason is not None:
            return out, reason


@dataclass
class Downstream:
    """What the execute/sample/detokenize stages keep per sequence."""

    prompt: tuple[int, ...]
    index: int
    params: SamplingParams
    request_id: str
    outputs: list[int] = field(default_factory=list)
    computed: int = 0  # end of the last scheduled chunk
    sampled: bool = False  # has a step sampled it yet?
    finish: FinishReason | None = None


class Simulation:
    def __init__(self, rng: random.Random, sched: Scheduler, block_size: int) -> None:
        self.rng = rng
        self.sched = sched
        self.bs = block_size
        self.cache: list[int | None] = [None] * (sched.kv.pool.num_blocks * block_size)
        self.live: dict[int, Downstream] = {}  # started and not yet released
        self.done: dict[int, Downstream] = {}  # released
        self.cut: set[int] = set()  # aborted or ended by a stop string: outputs are a prefix
        self.requests: list[str] = []
        self.max_batch_tokens = 0
        self.steps = 0
        self.placeholders = 0
        self.sampled_ids: dict[int, list[int]] = {}  # step id -> ids by sampling row
        self.batches: list[StepBatch] = []  # every step scheduled, in order
        self.finished: list[FinishedSeq] = []  # what every apply returned, in order

    def add_random_request(self) -> None:
        rng = self.rng
        rid = f"r{len(self.requests)}"
        shared = rng.choice(PREFIXES)  # common prefixes make prefix-cache hits likely
        suffix = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(0 if shared else 1, 12))]
        prompt = tuple((shared + suffix)[: self.sched.max_model_len - 1])
        params = SamplingParams(
            n=rng.choice([1, 1, 2, 3]),
            max_tokens=rng.choice([None, 1, 3, 8, 20]),
            min_tokens=rng.choice([0, 0, 2]),
            ignore_eos=rng.random() < 0.2,
            stop_token_ids=rng.choice([(), (5,), (3, 7)]),
            prompt_logprobs=1 if rng.random() < 0.15 else None,
        )
        if params.max_tokens is not None and params.max_tokens < params.min_tokens:
            params = SamplingParams(n=params.n, max_tokens=params.max_tokens)
        self.sched.add_request(
            TokenizedRequest(
                request_id=rid,
                prompt_token_ids=prompt,
                params=params,
                eos_token_ids=(EOS,),
                arrival_time=float(len(self.requests)),
            )
        )
        self.requests.append(rid)

    def slot(self, table: tuple[int, ...], pos: int) -> int:
        return table[pos // self.bs] * self.bs + pos % self.bs

    def schedule_step(self) -> StepBatch | None:
        """Schedule one step and check the policy against the scheduler's state now."""
        sched = self.sched
        # Decode-first and no starvation: every running sequence computes something, except
        # those waiting for a token in flight (all of them, or only those under a grammar or
        # at their last token with async scheduling).
        running = {s.seq_id for s in sched.running}
        ready = {
            s.seq_id
            for s in sched.running
            if not s.num_pending
            or (
                sched.async_scheduling
                and s.runs_ahead
                and len(s.token_ids) + s.num_pending - s.num_prompt_tokens < s.output_limit
            )
        }
        batch = sched.schedule()
        if batch is None:
            return None
        self.batches.append(batch)
        self.steps += 1
        num_tokens = sum(len(r.token_ids) for r in batch.rows)
        assert num_tokens <= sched.max_num_batched_tokens
        assert len(batch.rows) <= sched.max_num_seqs
        assert len({r.seq_id for r in batch.rows}) == len(batch.rows)
        now_running = {s.seq_id for s in sched.running}
        assert {r.seq_id for r in batch.rows} == (ready & now_running) | (now_running - running)
        return batch

    def execute_step(self, batch: StepBatch) -> None:
        """What execute, sample and detokenize do with a step, then `apply`."""
        sched = self.sched
        for start in batch.started:
            assert start.seq_id not in self.live and start.seq_id not in self.done
            self.live[start.seq_id] = Downstream(
                start.prompt_token_ids, start.index, start.params, start.request_id
            )
        for seq_id in batch.released:
            self.done[seq_id] = self.live.pop(seq_id)
        # Store every row's tokens first (as the model stores a layer's K/V before attending).
        for row in batch.rows:
            ds = self.live[row.seq_id]
            known = [*ds.prompt, *ds.outputs]
            start = row.num_computed_tokens
            if start != ds.computed:  # a restart after preemption: prefix hits only
                assert start % self.bs == 0 and start < len(known)
                if ds.params.prompt_logprobs is not None:
                    assert start == 0
            end = start + len(row.token_ids)
            token_ids = list(row.token_ids)
            if row.input_from is not None:  # a placeholder: the id its step sampled
                assert token_ids == [PLACEHOLDER_TOKEN] and sched.async_scheduling
                step_id, sampling_row = row.input_from
                assert step_id in batch.reads_sampled and step_id >= batch.inflight_from
                token_ids = [self.sampled_ids[step_id][sampling_row]]
                self.placeholders += 1
            assert len(row.block_table) * self.bs >= end
            assert end <= sched.max_model_len
            # A row scheduled before its sequence's last token was known computes a token
            # sample dropped: nothing to check but that it writes no one else's block.
            if ds.finish is None:
                assert token_ids == known[start:end]
                assert row.sample == (end == len(known))
                assert row.num_output_tokens == len(ds.outputs)
            # prompt logits: every chunk up to the first sampling step, never on recompute
            wants = ds.params.prompt_logprobs is not None and not ds.sampled
            assert (row.seq_id in batch.prompt_logits_for) == wants
            ds.sampled |= row.sample
            # A write that corrupted a block another sequence shares shows up when that
            # sequence reads its context back below (now or at a later step).
            for pos, tok in zip(range(start, end), token_ids, strict=True):
                self.cache[self.slot(row.block_table, pos)] = tok
            ds.computed = end
        sampled = []
        ids = self.sampled_ids[batch.step_id] = []
        for row in batch.rows:
            if not row.sample:
                continue
            ds = self.live[row.seq_id]
            context = [self.cache[self.slot(row.block_table, p)] for p in range(ds.computed)]
            tok = next_token(ds.index, context)  # type: ignore[arg-type]
            ids.append(tok)
            if ds.finish is not None:
                continue  # scheduled before its last token was known: dropped
            assert context == [*ds.prompt, *ds.outputs], f"seq {row.seq_id} read a wrong block"
            ds.outputs.append(tok)
            reason, stop_reason = stop_check(
                ds.params, tok, len(ds.outputs), ds.computed + 1, sched.max_model_len
            )
            ds.finish = reason
            sampled.append(
                SampledToken(
                    seq_id=row.seq_id, token_id=tok, finish_reason=reason, stop_reason=stop_reason
                )
            )
        finished = sched.apply(
            StepTokens(step_id=batch.step_id, sampled=SampledTokens.of(tuple(sampled)))
        )
        for f in finished:
            assert f.finish_reason == self.live[f.seq_id].finish
        self.finished.extend(finished)

    def random_interrupts(self) -> None:
        rng = self.rng
        if self.live and rng.random() < 0.05:
            rid = rng.choice(sorted({d.request_id for d in self.live.values()}))
            for f in self.sched.abort_request(rid):
                self.cut.add(f.seq_id)
        if self.live and rng.random() < 0.05:
            seq_id = rng.choice(sorted(self.live))
            if self.sched.finish_sequence(seq_id, "stop-string") is not None:
                self.cut.add(seq_id)


def run(seed: int, block_size: int, extra_blocks: int, budget: int, max_num_seqs: int,
        caching: bool, max_model_len: int, inflight: int = 1,
        async_scheduling: bool = False, columns_from: int = 1) -> Simulation:  # fmt: skip
    """One random workload; `inflight` steps may be scheduled before the oldest is applied
    (steps execute and apply in the order they were scheduled, as in the graph). The
    running sequences are scheduled as columns from `columns_from` of them on."""
    rng = random.Random(seed)
    num_blocks = -(-max_model_len // block_size) + extra_blocks
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        async_scheduling=async_scheduling,
    )
    sched.columns_from = columns_from
    sim = Simulation(rng, sched, block_size)
    num_requests = rng.randrange(1, 12)
    for _ in range(min(3, num_requests)):
        sim.add_random_request()
    pipeline: deque[StepBatch] = deque()
    for _ in range(4000):
        if len(sim.requests) < num_requests and rng.random() < 0.4:
            sim.add_random_request()
        sim.random_interrupts()
        while len(pipeline) < inflight and (batch := sim.schedule_step()) is not None:
            pipeline.append(batch)
        if pipeline:
            sim.execute_step(pipeline.popleft())
        elif len(sim.requests) >= num_requests:
            break
    assert not sched.has_unfinished()
    assert sched.schedule() is None  # the last released ids went out in an empty batch
    assert not sim.live
    # Every block is back; cached ones stay cached but free.
    pool = sched.kv.pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks and sched.stats.kv_cache_usage == 0.0
    # The oracle: sequential generation of each prompt.
    for seq_id, ds in sim.done.items():
        expected, reason = reference(ds.prompt, ds.index, ds.params, max_model_len)
        if seq_id in sim.cut:
            assert ds.outputs == expected[: len(ds.outputs)]
        else:
            assert (ds.outputs, ds.finish) == (expected, reason), f"seq {seq_id}"
    return sim


# One random workload's shape: `run`'s arguments but the way the running rows are taken.
WORKLOADS = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 2**32 - 1),
        "block_size": st.sampled_from([1, 2, 4, 8]),
        "extra_blocks": st.integers(0, 12),
        "budget": st.integers(4, 48),
        "max_num_seqs": st.integers(1, 8),
        "caching": st.booleans(),
        "max_model_len": st.integers(12, 40),
        "inflight": st.sampled_from([1, 1, 2, 3]),
        "async_scheduling": st.booleans(),
    }
)


@settings(max_examples=120, deadline=None)
@given(workload=WORKLOADS, columns_from=st.sampled_from([1, 3, NEVER]))
def test_simulated_engine_matches_sequential_generation(
    workload: dict[str, Any], columns_from: int
) -> None:
    run(**workload, columns_from=columns_from)


@settings(max_examples=60, deadline=None)
@given(workload=WORKLOADS)
def test_columns_and_one_by_one_schedule_the_same_steps(workload: dict[str, Any]) -> None:
    """The running sequences scheduled and applied as columns give the very steps (rows,
    tokens, blocks, placeholders, prompt logits, releases) and finishes that one by one
    does, step after step: preemptions, aborts, stop strings and placeholders included."""
    columns = run(**workload, columns_from=1)
    one_by_one = run(**workload, columns_from=NEVER)
    assert columns.batches == one_by_one.batches
    assert columns.finished == one_by_one.finished


def test_tight_cache_forces_preemptions_and_prefix_hits() -> None:
    """A fixed heavy case, so preemption and prefix hits are certainly exercised."""
    for columns_from in (1, NEVER):
        total_preemptions = total_hits = 0
        for seed in range(12):
            sim = run(seed, 4, 2, 24, 6, True, 32, columns_from=columns_from)
            total_preemptions += sim.sched.stats.num_preemptions
            total_hits += sim.sched.stats.prefix_cache_hits
        assert total_preemptions > 10
        assert total_hits > 100


def test_async_scheduling_reads_placeholders_and_matches() -> None:
    """Fixed cases with two and three steps in flight: placeholders certainly come up, and
    every output still equals sequential generation."""
    for inflight, columns_from in itertools.product((2, 3), (1, NEVER)):
        placeholders = preemptions = 0
        for seed in range(8):
            sim = run(seed, 4, 2, 24, 6, True, 32, inflight, True, columns_from)
            placeholders += sim.placeholders
            preemptions += sim.sched.stats.num_preemptions
        assert placeholders > 100 and preemptions > 0
