"""execute: one model forward per StepBatch, in its worker thread so HTTP keeps flowing.

It owns the KV cache tensors (through its ModelRunner) and keeps no per-sequence state:
the batch names the sequences whose prompt logits it returns (`prompt_logits_for`,
decided by schedule). `ExecuteHidden`, a pooling graph's execute, returns the last hidden
states of every row instead of logits, for pool; it keeps only where each cross-encoder
pair's second text starts (its token types), from the step it starts to its release.
"""

from __future__ import annotations

from flowllm.graph.stage import NoParams, PerMessageStage, StageContext
from flowllm.messages import StepBatch, StepHidden, StepLogits
from flowllm.models.decode_buckets import DecodeBuckets, capture_sizes
from flowllm.models.runner import ModelRunner
from flowllm.models.warm_up import warm_up
from flowllm.stages.services import EngineServices


def model_runner(services: EngineServices) -> ModelRunner:
    """Execute's runner. On CUDA, for a model served for generation, one for every run of
    the graph (the offline API starts one per call), built with every kernel compiled and
    every decode graph captured (flowllm/models/warm_up.py); otherwise a new one per run,
    whose CPU plans are recorded as steps come."""
    if services.pooler is not None or services.device.type != "cuda":
        return _runner(services, None)
    return services.shared("model_runner", lambda: _warmed_up_runner(services))


def _runner(services: EngineServices, decode_buckets: DecodeBuckets | None) -> ModelRunner:
    config = services.config
    return ModelRunner(
        services.model,
        services.kv_caches,
        config.cache.block_size,
        services.device,
        enforce_eager=config.model.enforce_eager,
        small_step_threads=services.small_step_threads,
        decode_buckets=decode_buckets,
    )


def _warmed_up_runner(services: EngineServices) -> ModelRunner:
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


class Execute(PerMessageStage):
    inputs = {"in": StepBatch}
    outputs = {"out": StepLogits}

    def __init__(self, params: NoParams, services: EngineServices) -> None:
        super().__init__(params, services)
        self.runner = model_runner(services)
        self._worker = services.worker_thread("execute")

    async def handle(self, batch: StepBatch, ctx: StageContext) -> None:
        logits, prompt_logits = await self._worker.run(
            self.runner.run, batch.seqs, batch.prompt_logits_for
        )
        await ctx.emit("out", StepLogits(batch=batch, logits=logits, prompt_logits=prompt_logits))


class ExecuteHidden(Execute):
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
        hidden = await self._worker.run(self.runner.hidden_states, batch.seqs, self._type_starts)
        await ctx.emit("out", StepHidden(batch=batch, hidden=hidden))
