"""sample: one batched sampling call per step, in its worker thread.

It learns each sequence's parameters from `StepBatch.started`, decides every sampled
token's finish reason (flowllm.engine.stopping), and sends the same `StepTokens` to
schedule (which appends them) and detokenize (which turns them into text).
"""

from __future__ import annotations

from typing import Any

from flowllm.engine.sampler import Sampler
from flowllm.messages import StepLogits, StepTokens, TokenLogprobs
from flowllm.stages.base import PerMessageStage, StageContext
from flowllm.stages.services import EngineServices


class Sample(PerMessageStage):
    inputs = {"in": StepLogits}
    outputs = {"out": StepTokens}

    def __init__(self, params: Any, services: EngineServices) -> None:
        super().__init__(params, services)
        self.sampler = Sampler(
            seed=services.config.model.seed,
            max_model_len=services.max_model_len,
            device=services.device,
        )
        self._worker = services.worker_thread("sample")

    def live_sequences(self) -> int:
        return len(self.sampler)

    async def handle(self, step: StepLogits, ctx: StageContext) -> None:
        tokens = await self._worker.run(self._sample, step)
        await ctx.emit("out", tokens)

    def _sample(self, step: StepLogits) -> StepTokens:
        batch = step.batch
        sampler = self.sampler
        for seq_id in batch.released:
            sampler.release(seq_id)
        for start in batch.started:
            sampler.start(start)
        seq_ids: list[int] = []
        num_output_tokens: list[int] = []
        for s in batch.seqs:
            if s.sample:
                seq_ids.append(s.seq_id)
                num_output_tokens.append(s.num_output_tokens)
        tokens = sampler.sample(seq_ids, step.logits, num_output_tokens) if seq_ids else []
        prompt_logprobs: dict[int, tuple[TokenLogprobs | None, ...]] = {}
        if step.prompt_logits:
            computed = {s.seq_id: s.num_computed_tokens for s in batch.seqs}
            for seq_id, logits in step.prompt_logits.items():
                prompt_logprobs[seq_id] = sampler.prompt_logprobs(seq_id, computed[seq_id], logits)
        return StepTokens(
            step_id=batch.step_id,
            tokens=tuple(tokens),
            started=batch.started,
            released=batch.released,
            prompt_logprobs=prompt_logprobs,
        )
