"""execute: one model forward per StepBatch, in its worker thread so HTTP keeps flowing.

It owns the KV cache tensors (through its ModelRunner) and keeps no per-sequence state:
the batch names the sequences whose prompt logits it returns (`prompt_logits_for`,
decided by schedule).
"""

from __future__ import annotations

from flowllm.graph.stage import NoParams, PerMessageStage, StageContext
from flowllm.messages import StepBatch, StepLogits
from flowllm.models.runner import ModelRunner
from flowllm.stages.services import EngineServices


class Execute(PerMessageStage):
    inputs = {"in": StepBatch}
    outputs = {"out": StepLogits}

    def __init__(self, params: NoParams, services: EngineServices) -> None:
        super().__init__(params, services)
        config = services.config
        self.runner = ModelRunner(
            services.model,
            services.kv_caches,
            config.cache.block_size,
            services.device,
            enforce_eager=config.model.enforce_eager,
            small_step_threads=services.small_step_threads,
        )
        self._worker = services.worker_thread("execute")

    async def handle(self, batch: StepBatch, ctx: StageContext) -> None:
        logits, prompt_logits = await self._worker.run(
            self.runner.run, batch.seqs, batch.prompt_logits_for
        )
        await ctx.emit("out", StepLogits(batch=batch, logits=logits, prompt_logits=prompt_logits))
