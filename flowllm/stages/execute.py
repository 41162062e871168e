"""execute: one model forward per StepBatch, in its worker thread so HTTP keeps flowing.

It owns the KV cache tensors (through its ModelRunner) and keeps no per-sequence state:
the batch names the sequences whose prompt logits it returns (`prompt_logits_for`,
decided by schedule). With async scheduling a batch may arrive before the tokens of the
step ahead of it are sampled: its placeholder rows read them from the `SampledIds` that
sample sends back on `sampled` (kept, on the model's device, while a later batch may still
read them). `ExecuteHidden`, a pooling graph's execute, returns the last hidden states of
every row instead of logits, for pool; it keeps only where each cross-encoder pair's second
text starts (its token types), from the step it starts to its release.

Its runner keeps the heap its steps free mapped for the next steps (flowllm/models/
glibc_heap.py); once no step has come for a while, it gives that memory back
(`IdleHeapTrim`).

A front process imports this module to check the graph's edges, and loads no torch: the
model's modules are imported where a runner is built, in the process that runs execute.
"""

from __future__ import annotations

from time import perf_counter
from typing import TYPE_CHECKING, Any

import anyio

from flowllm.graph.channel import ChannelReceiver
from flowllm.graph.stage import CLOSED, NoParams, PerMessageStage, StageContext
from flowllm.messages import SampledIds, StepBatch, StepHidden, StepLogits
from flowllm.models import glibc_heap
from flowllm.stages.idle_heap_trim import IdleHeapTrim
from flowllm.stages.services import EngineServices

if TYPE_CHECKING:
    import torch

    from flowllm.models.decode_buckets import DecodeBuckets
    from flowllm.models.runner import ModelRunner


class MissingSampledIdsError(RuntimeError):
    """A batch reads ids sampled in flight, but they cannot come (the graph does not
    connect sample.ids to execute.sampled, or the input closed)."""


def model_runner(services: EngineServices) -> ModelRunner:
    """Execute's runner. On CUDA, for a model served for generation, one for every run of
    the graph (the offline API starts one per call), built with every kernel compiled and
    every decode graph captured (flowllm/models/warm_up.py); otherwise a new one per run,
    whose CPU plans are recorded as steps come."""
    if services.pooler is not None or services.model_device().type != "cuda":
        return _runner(services, None)
    return services.shared("model_runner", lambda: _warmed_up_runner(services))


def _runner(services: EngineServices, decode_buckets: DecodeBuckets | None) -> ModelRunner:
    from flowllm.models.runner import ModelRunner

    config = services.config
    return ModelRunner(
        services.model,
        services.kv_caches,
        config.cache.block_size,
        services.model_device(),
        enforce_eager=config.model.enforce_eager,
        decode_buckets=decode_buckets,
    )


def _warmed_up_runner(services: EngineServices) -> ModelRunner:
    from flowllm.models.decode_buckets import DecodeBuckets, capture_sizes
    from flowllm.models.warm_up import warm_up

    config = services.config
    sizes = capture_sizes(
        config.scheduler.max_num_seqs,
        config.model.cudagraph_capture_sizes,
        config.model.max_cudagraph_capture_size,
    )
    block_size = config.cache.block_size
    runner = _runner(services, DecodeBuckets.for_context(sizes, services.max_model_len, block_size))
    warm_up(runner, min(config.scheduler.max_num_batched_tokens, services.max_model_len))
    return runner


def step_size(batch: StepBatch) -> tuple[int, int, bool]:
    """A step's size class, for its worker (a short step runs on the loop): its sequences
    and tokens to the next power of two, and whether it returns prompt logits."""
    rows = batch.rows
    return (
        len(rows.seq_ids).bit_length(),
        len(rows.token_ids).bit_length(),
        bool(batch.prompt_logits_for),
    )


class Execute(PerMessageStage):
    inputs = {"in": StepBatch, "sampled": SampledIds}
    optional_inputs = frozenset({"sampled"})
    outputs = {"out": StepLogits}

    def __init__(self, params: NoParams, services: EngineServices) -> None:
        super().__init__(params, services)
        self.runner = model_runner(services)
        self._worker = services.model_thread()
        self._sampled: dict[int, torch.Tensor] = {}  # step id -> its sampled ids
        # The runner keeps freed heap mapped for the next steps (glibc_heap): once steps
        # stop coming, this gives it back.
        self._idle_trim = IdleHeapTrim(trim=self._trim_heap)
        self._metrics = services.metrics

    async def run(self, ctx: StageContext) -> None:
        try:
            await self._steps(ctx)
        finally:
            self._idle_trim.close()

    async def _steps(self, ctx: StageContext) -> None:
        sampled = ctx.inbox("sampled") if "sampled" in ctx.input_ports else None
        idle_trim = self._idle_trim
        while True:
            # Ids may come before the batch that reads them: take whichever is first.
            try:
                port, message = await ctx.receive_any()
            except anyio.EndOfStream:
                return
            if message is CLOSED:
                continue
            if sampled is not None and port == "sampled":
                self._keep(message, sampled, ctx)
                continue
            idle_trim.stepping()
            with ctx.handling(message):
                if sampled is None:
                    await self.handle(message, ctx)
                else:
                    sampled_ids = await self._read_sampled(message, sampled, ctx)
                    await self.execute_step(message, sampled_ids, ctx)
            idle_trim.stepped()

    def _trim_heap(self) -> None:
        if glibc_heap.trim():
            self._metrics.heap_trims.inc()

    async def handle(self, batch: StepBatch, ctx: StageContext) -> None:
        if batch.reads_sampled:
            raise MissingSampledIdsError(
                f"step {batch.step_id} reads ids sampled in flight, but nothing sends them: "
                "connect sample.ids to execute.sampled"
            )
        await self.execute_step(batch, None, ctx)

    async def execute_step(
        self, batch: StepBatch, sampled: dict[int, torch.Tensor] | None, ctx: StageContext
    ) -> None:
        """Run one step (its placeholder rows reading `sampled`) and send its logits; a
        short one may run on the loop, where its results do not depend on the thread."""
        size = step_size(batch) if self.runner.exact_on_any_threads else None
        logits, prompt_logits = await self._worker.run(
            self.runner.run, batch.rows, batch.prompt_logits_for, sampled, size=size
        )
        await ctx.emit("out", StepLogits(batch=batch, logits=logits, prompt_logits=prompt_logits))

    async def _read_sampled(
        self, batch: StepBatch, inbox: ChannelReceiver[Any], ctx: StageContext
    ) -> dict[int, torch.Tensor] | None:
        """The sampled ids `batch` reads, waiting for those not here yet; ids no later
        batch reads are dropped."""
        kept = self._sampled
        for step_id in [s for s in kept if s < batch.inflight_from]:
            del kept[step_id]
        for step_id in batch.reads_sampled:
            while step_id not in kept:
                try:
                    message = await inbox.receive()
                except anyio.EndOfStream:
                    raise MissingSampledIdsError(
                        f"step {batch.step_id} reads the ids sampled in step {step_id}, "
                        "but its input closed first"
                    ) from None
                self._keep(message, inbox, ctx)
        return {step_id: kept[step_id] for step_id in batch.reads_sampled} or None

    def _keep(self, message: SampledIds, inbox: ChannelReceiver[Any], ctx: StageContext) -> None:
        """Keep a step's ids; a span marks the receipt, so a trace shows (and a replay
        feeds) when they came."""
        ctx.spans.record(message, perf_counter(), inbox.last_wait, observed=False)
        self._sampled[message.step_id] = message.ids


class ExecuteHidden(Execute):
    inputs = {"in": StepBatch}
    optional_inputs = frozenset()
    outputs = {"out": StepHidden}

    def __init__(self, params: NoParams, services: EngineServices) -> None:
        super().__init__(params, services)
        self._type_starts: dict[int, int] = {}  # seq id -> token_type_start, pairs only

    async def handle(self, batch: StepBatch, ctx: StageContext) -> None:
        for seq_id in batch.released:
            self._type_starts.pop(seq_id, None)
        for start in batch.started:
            if start.pooling is not None and start.pooling.token_type_start is not None:
                self._type_starts[start.seq_id] = start.pooling.token_type_start
        hidden = await self._worker.run(self.runner.hidden_states, batch.rows, self._type_starts)
        await ctx.emit("out", StepHidden(batch=batch, hidden=hidden))
