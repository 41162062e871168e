"""propose: draft tokens for each sequence's next step (speculative decoding).

It sits between sample and schedule on the step loop: each step's `StepTokens` passes
through it with `drafts` added, one tuple per sequence that goes on, proposed from the
sequence's prompt and outputs so far by the method of the engine's speculative config
(ngram: prompt lookup, flowllm.sampling.ngram; draft_model: a draft model's greedy
continuation, flowllm.models.draft_proposer, run in the stage's worker thread on the draft's
own KV cache). It learns each sequence's prompt from the `StepBatch` of the step
(`batches`, a tap of schedule.out: batches and tokens come one to one, in step order), and
forgets it, and frees its draft KV blocks, on release. schedule decides which drafts a step
runs; execute computes them after the sequence's last token, and sample verifies them.

A restarted stage starts from nothing: the sequences it never saw start get no drafts,
and a new draft proposer's cache holds no sequence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio

from flowllm.config import ConfigError
from flowllm.graph.stage import NoParams, Stage, StageContext
from flowllm.messages import StepBatch, StepTokens
from flowllm.sampling.ngram import TokenLog, propose
from flowllm.stages.services import EngineServices

if TYPE_CHECKING:
    from flowllm.models.draft_proposer import DraftProposer


class ProposeError(RuntimeError):
    """A step's tokens met another step's batch (a bug upstream)."""


class Propose(Stage):
    inputs = {"in": StepTokens, "batches": StepBatch}
    outputs = {"out": StepTokens}

    def __init__(self, params: NoParams, services: EngineServices) -> None:
        super().__init__(params, services)
        config = services.config.speculative
        if config is None:
            raise ConfigError("the propose stage needs a speculative config (--speculative-config)")
        self._k = config.num_speculative_tokens
        self._min_n = config.prompt_lookup_min
        self._max_n = config.prompt_lookup_max
        # schedule runs no drafts in a step of more running sequences than this: none are
        # proposed after a step that sampled more
        self._up_to = config.disable_by_batch_size
        self._logs: dict[int, TokenLog | None] = {}  # seq id -> its tokens; None: no drafts
        self.drafter: DraftProposer | None = None
        if config.method == "draft_model":
            self.drafter = _drafter(services, self._k)
            self._worker = services.model_thread()

    def live_sequences(self) -> int:
        return len(self._logs)

    async def run(self, ctx: StageContext) -> None:
        batches, tokens_in = ctx.inbox("batches"), ctx.inbox("in")
        while True:
            try:
                batch = await batches.receive()
                step = await tokens_in.receive()
            except anyio.EndOfStream:
                return
            with ctx.handling(step, tokens_in.last_wait):
                if batch.step_id != step.step_id:
                    raise ProposeError(f"step {step.step_id}'s tokens met step {batch.step_id}")
                await ctx.emit("out", await self._propose(batch, step))

    async def _propose(self, batch: StepBatch, step: StepTokens) -> StepTokens:
        logs = self._logs
        for seq_id in batch.released:
            logs.pop(seq_id, None)
        if self.drafter is not None:
            self.drafter.release(batch.released)
        for start in batch.started:
            takes = start.params.takes_drafts
            logs[start.seq_id] = TokenLog(start.prompt_token_ids) if takes else None
        going: dict[int, TokenLog] = {}
        rows = step.sampled
        for row, (seq_id, token_id) in enumerate(zip(rows.seq_ids, rows.token_ids, strict=True)):
            log = logs.get(seq_id)
            if log is None:
                continue
            log.append(token_id)
            if row in rows.finishes:
                going.pop(seq_id, None)
            else:
                going[seq_id] = log
        if not going or (self._up_to is not None and len(going) > self._up_to):
            return step
        drafts: dict[int, tuple[int, ...]] = {}
        if self.drafter is not None:
            ids = {seq_id: log.ids for seq_id, log in going.items()}
            drafts = await self._worker.run(self.drafter.propose, ids)
        else:
            for seq_id, log in going.items():
                proposed = propose(log.ids, self._k, self._min_n, self._max_n)
                if proposed:
                    drafts[seq_id] = proposed
        if not drafts:
            return step
        return StepTokens(
            step_id=step.step_id,
            sampled=step.sampled,
            prompt_logprobs=step.prompt_logprobs,
            drafts=drafts,
        )


def _drafter(services: EngineServices, k: int) -> DraftProposer:
    """The draft model's proposer for one run of the graph (torch is imported here, in the
    process that runs the step loop)."""
    from flowllm.models.draft_proposer import DraftProposer

    if services.draft is None:
        raise ConfigError("method 'draft_model' needs a draft model loaded with the target")
    config = services.config
    return DraftProposer(
        services.draft,
        k,
        config.scheduler.max_num_batched_tokens,
        enforce_eager=config.model.enforce_eager,
    )
