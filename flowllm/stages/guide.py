"""guide: the allowed next tokens of constrained sequences, computed beside the model step.

It receives every `StepBatch` at the same time as execute (a fan-out of `schedule.out`)
and, in its worker thread while the model runs, advances each constrained sequence's
matcher by the token it sampled last step and fills the sequence's row of the step's
bitmask; sample joins the `StepMasks` with the step's logits. A step without constrained
sequences costs one empty message.

The matcher of a sequence has accepted exactly its output tokens so far: a sampling row
with `num_output_tokens = m` needs output m - 1 accepted, and that token is among the
row's `token_ids` (the last one for a decode; inside the chunk for a recompute after
preemption, where the matcher has usually accepted it already). Prefix-cache hits and
prefill chunks that do not sample change nothing.
"""

from __future__ import annotations

from flowllm.graph.stage import NoParams, PerMessageStage, StageContext
from flowllm.graph.validator import ValidGraph
from flowllm.messages import ScheduledSeq, StepBatch, StepMasks
from flowllm.sampling.grammar import Grammars, Matcher
from flowllm.stages.services import EngineServices


class GuideError(RuntimeError):
    """A constrained sequence's tokens and its matcher disagree (a bug upstream)."""


class _Guided:
    """What guide keeps about one constrained sequence."""

    __slots__ = ("matcher", "num_accepted", "num_prompt_tokens")

    def __init__(self, matcher: Matcher, num_prompt_tokens: int) -> None:
        self.matcher = matcher
        self.num_prompt_tokens = num_prompt_tokens
        self.num_accepted = 0  # output tokens the matcher has accepted


class Guide(PerMessageStage):
    inputs = {"in": StepBatch}
    outputs = {"out": StepMasks}
    on_error = "restart"

    def __init__(self, params: NoParams, services: EngineServices) -> None:
        super().__init__(params, services)
        self._services = services
        self._seqs: dict[int, _Guided] = {}
        self._worker = services.worker_thread("guide")

    @property
    def grammars(self) -> Grammars:
        return self._services.grammars()

    def live_sequences(self) -> int:
        return len(self._seqs)

    async def handle(self, batch: StepBatch, ctx: StageContext) -> None:
        constrained = any(s.params.structured_outputs is not None for s in batch.started)
        if not self._seqs and not constrained:  # nothing to follow, nothing to release
            await ctx.emit("out", StepMasks(step_id=batch.step_id))
            return
        masks = await self._worker.run(self._fill, batch)
        await ctx.emit("out", masks)

    def _fill(self, batch: StepBatch) -> StepMasks:
        seqs = self._seqs
        for seq_id in batch.released:
            seqs.pop(seq_id, None)
        for start in batch.started:
            spec = start.params.structured_outputs
            if spec is not None:
                seqs[start.seq_id] = _Guided(
                    self.grammars.matcher(spec), len(start.prompt_token_ids)
                )
        rows = [s for s in batch.seqs if s.sample and s.seq_id in seqs]
        if not rows:
            return StepMasks(step_id=batch.step_id)
        bitmask = self.grammars.allocate_bitmask(len(rows))
        for i, row in enumerate(rows):
            guided = seqs[row.seq_id]
            _catch_up(guided, row)
            guided.matcher.fill(bitmask, i)
        return StepMasks(
            step_id=batch.step_id, seq_ids=tuple(s.seq_id for s in rows), bitmask=bitmask
        )


def has_guide(graph: ValidGraph) -> bool:
    """Whether `graph` computes grammar masks (else constrained requests are refused)."""
    return any(issubclass(bound.cls, Guide) for bound in graph.stages.values())


def _catch_up(guided: _Guided, row: ScheduledSeq) -> None:
    """Accept the outputs sampled since the matcher last moved (found in the row's tokens)."""
    while guided.num_accepted < row.num_output_tokens:
        position = guided.num_prompt_tokens + guided.num_accepted
        offset = position - row.num_computed_tokens
        if not 0 <= offset < len(row.token_ids):
            raise GuideError(
                f"seq {row.seq_id}: output token {guided.num_accepted} is not in this step's "
                f"tokens (positions {row.num_computed_tokens}..."
                f"{row.num_computed_tokens + len(row.token_ids) - 1})"
            )
        token = row.token_ids[offset]
        if not guided.matcher.accept(token) and not guided.matcher.terminated:
            raise GuideError(f"seq {row.seq_id}: token {token} is not allowed by its grammar")
        guided.num_accepted += 1
