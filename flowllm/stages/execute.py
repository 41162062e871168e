"""execute: one model forward per StepBatch, in its worker thread so HTTP keeps flowing.

It owns the KV cache tensors (through its ModelRunner) and asks for prompt logits only for
sequences that want prompt logprobs, and only until their prompt has been computed once
(a recompute after preemption does not ask again).
"""

from __future__ import annotations

from typing import Any

from flowllm.graph.stage import PerMessageStage, StageContext
from flowllm.messages import StepBatch, StepLogits
from flowllm.models.runner import ModelRunner
from flowllm.stages.services import EngineServices


class Execute(PerMessageStage):
    inputs = {"in": StepBatch}
    outputs = {"out": StepLogits}

    def __init__(self, params: Any, services: EngineServices) -> None:
        super().__init__(params, services)
        config = services.config
        self.runner = ModelRunner(
            services.model,
            services.kv_caches,
            config.cache.block_size,
            services.device,
            enforce_eager=config.model.enforce_eager,
        )
        self._want_prompt_logits: set[int] = set()
        self._worker = services.worker_thread("execute")

    def live_sequences(self) -> int:
        return len(self._want_prompt_logits)

    async def handle(self, batch: StepBatch, ctx: StageContext) -> None:
        want = self._want_prompt_logits
        want.update(s.seq_id for s in batch.started if s.params.prompt_logprobs is not None)
        want.difference_update(batch.released)
        asked = {s.seq_id for s in batch.seqs if s.seq_id in want} if want else set()
        logits, prompt_logits = await self._worker.run(self.runner.run, batch.seqs, asked)
        if asked:
            want.difference_update(s.seq_id for s in batch.seqs if s.sample and s.seq_id in asked)
        await ctx.emit("out", StepLogits(batch=batch, logits=logits, prompt_logits=prompt_logits))
