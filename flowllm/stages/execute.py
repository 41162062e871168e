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


class Execute(PerMessageStage):
    inputs = {"in": StepBatch}
    outputs = {"out": StepLogits}

    def __init__(self, params: NoParams, services: EngineServices) -> None:
        super().__init__(params, services)
        config = services.config
        generates = services.pooler is None
        self.runner = ModelRunner(
            services.model,
            services.kv_caches,
            config.cache.block_size,
            services.device,
            enforce_eager=config.model.enforce_eager,
            small_step_threads=services.small_step_threads,
            decode_buckets=DecodeBuckets.for_context(
                capture_sizes(
                    config.scheduler.max_num_seqs,
                    config.model.cudagraph_capture_sizes,
                    config.model.max_cudagraph_capture_size,
                ),
                services.max_model_len,
                config.cache.block_size,
            )
            if generates
            else None,
        )
        if generates:  # on CUDA: every kernel compiled, every decode graph captured
            warm_up(
                self.runner,
                min(config.scheduler.max_num_batched_tokens, services.max_model_len),
            )
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
