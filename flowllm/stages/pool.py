"""pool: a pooling graph's step end. Turns the hidden states of each prompt that finished
its prefill into its vector, in its worker thread.

It learns each choice from `schedule` (`ChoiceEvents` on `choices`, read first, so a
choice is known before its rows arrive) and forgets it once pooled, or on `ended`
(aborted). Each step it sends one `StepTokens` to schedule, a finishing entry for every
prompt it pooled (a pooling request generates nothing: its one entry ends it), and the
vectors to deliver as chunks (`Chunk.pooled`, float32 little-endian), which cross to the
front without a tensor. The pooling itself is `flowllm.models.pooling`, imported where
the stage is built: a front process imports this module to check the graph's edges, and
loads no torch.
"""

from __future__ import annotations

import numpy as np

from flowllm.graph.stage import NoParams, PerMessageStage, StageContext
from flowllm.messages import (
    ChoiceEvents,
    ChoiceStart,
    Chunk,
    PoolingParams,
    SampledTokens,
    StepHidden,
    StepTokens,
    TextDeltas,
)
from flowllm.stages.services import EngineServices

# The token id of a pooled prompt's finishing entry: schedule ends the sequence on it and
# appends nothing (a pooling sequence generates nothing); nothing reads it.
FINISHED_TOKEN = 0


class PoolingUnavailableError(ValueError):
    """The graph has a pool stage but the model is served for generation."""


class Pool(PerMessageStage):
    inputs = {"choices": ChoiceEvents, "in": StepHidden}
    outputs = {"out": StepTokens, "chunks": TextDeltas}

    def __init__(self, params: NoParams, services: EngineServices) -> None:
        from flowllm.models.pooling import Pooler

        super().__init__(params, services)
        config = services.pooler
        if config is None:
            raise PoolingUnavailableError(
                "the pool stage needs a model served for pooling (--task embed or score)"
            )
        self.pooler = Pooler(config, services.model if config.task == "score" else None)
        self._choices: dict[int, ChoiceStart] = {}
        self._worker = services.step_thread("pool")

    def live_sequences(self) -> int:
        return len(self._choices)

    def request_ids(self, message: object) -> tuple[str, ...]:
        """A step's requests, as far as their choices are known."""
        if isinstance(message, StepHidden):
            choices = (self._choices.get(seq_id) for seq_id in message.batch.rows.seq_ids)
            return tuple(dict.fromkeys(c.request_id for c in choices if c is not None))
        return super().request_ids(message)

    async def handle(self, message: ChoiceEvents | StepHidden, ctx: StageContext) -> None:
        if isinstance(message, ChoiceEvents):
            for choice in message.started:
                self._choices[choice.seq_id] = choice
            for seq_id in message.ended:
                self._choices.pop(seq_id, None)
            return
        tokens, chunks = await self._worker.run(self._pool, message)
        await ctx.emit("out", tokens)  # schedule first: it frees the step's credit
        if chunks:
            await ctx.emit("chunks", TextDeltas(step_id=tokens.step_id, chunks=chunks))

    def _pool(self, step: StepHidden) -> tuple[StepTokens, tuple[Chunk, ...]]:
        """Pool every prompt that ends in this step (rows in batch order)."""
        spans: list[tuple[int, int]] = []
        params: list[PoolingParams | None] = []
        finished: list[ChoiceStart] = []
        start = 0
        rows = step.batch.rows
        for seq_id, length, sample in zip(rows.seq_ids, rows.query_lens, rows.sample, strict=True):
            end = start + length
            choice = self._choices.get(seq_id)
            if sample and choice is not None:  # its prompt's last row is in this step
                spans.append((start, end))
                params.append(choice.seq.pooling)
                finished.append(choice)
            start = end
        vectors = self.pooler(step.hidden, spans, params)
        chunks = []
        for choice, vector in zip(finished, vectors, strict=True):
            del self._choices[choice.seq_id]
            prompt = choice.seq.prompt_token_ids
            chunks.append(
                Chunk(
                    request_id=choice.request_id,
                    index=choice.seq.index,
                    text="",
                    token_ids=(),
                    finish_reason="stop",
                    num_prompt_tokens=len(prompt),
                    prompt_token_ids=prompt,
                    scheduled_time=choice.scheduled_time,
                    pooled=np.asarray(vector.cpu(), dtype="<f4").tobytes(),
                )
            )
        sampled = SampledTokens(
            seq_ids=tuple([c.seq_id for c in finished]),
            token_ids=(FINISHED_TOKEN,) * len(finished),
            finishes=dict.fromkeys(range(len(finished)), ("stop", None)),
        )
        return StepTokens(step_id=step.batch.step_id, sampled=sampled), tuple(chunks)
