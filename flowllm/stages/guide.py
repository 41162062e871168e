"""guide: the allowed next tokens of constrained sequences, computed beside the model step.

It receives the `StepBatch`es that concern constrained sequences from `schedule.guide`,
sent beside the same batches to execute (every batch while a constrained sequence is
unfinished, and the next, which releases the last), and, in its worker thread while the
model runs, advances each constrained sequence's matcher by the token it sampled last
step and fills the sequence's row of the step's bitmask; sample joins the `StepMasks`
with the step's logits. Only a step whose batch is `guided` (schedule marks those with a
constrained sampling row) gets one: for every other step guide sends nothing and sample
waits for nothing.

The matcher of a sequence has accepted exactly its output tokens so far: a sampling row
with `num_output_tokens = m` needs output m - 1 accepted, and that token is among the
row's `token_ids` (the last one for a decode; inside the chunk for a recompute after
preemption, where the matcher has usually accepted it already), or among the drafts its
last sampling row verified, those that were accepted. Prefix-cache hits and prefill
chunks that do not sample change nothing.

A row that verifies d drafts (speculative decoding) gets d + 1 masks, one per position:
the matcher follows the drafts tentatively, filling the mask after each, and is rolled
back. From the first draft its grammar forbids, the rows repeat the last mask: that
draft cannot be drawn, so verification stops there and the later rows are never read.

A constraint with `after_reasoning` (chat on a server with a reasoning parser) applies to
the answer only: a `ReasoningTracker` (flowllm.text.reasoning) follows the sequence's
tokens, its row gets no mask while it thinks, and the matcher accepts the tokens after
`</think>`. Where the output may still open its thinking part (qwen3's first token), the
row allows `<think>` besides what the grammar allows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flowllm.graph.stage import NoParams, PerMessageStage, StageContext
from flowllm.graph.validator import ValidGraph
from flowllm.messages import ScheduledSeq, StepBatch, StepMasks
from flowllm.sampling.grammar import Grammars, Matcher, allow_token
from flowllm.stages.services import EngineServices
from flowllm.text.reasoning import ReasoningTracker

if TYPE_CHECKING:
    import torch


class GuideError(RuntimeError):
    """A constrained sequence's tokens and its matcher disagree (a bug upstream)."""


class _Guided:
    """What guide keeps about one constrained sequence."""

    __slots__ = ("last_row", "matcher", "num_accepted", "num_prompt_tokens", "reasoning")

    def __init__(
        self, matcher: Matcher, num_prompt_tokens: int, reasoning: ReasoningTracker | None
    ) -> None:
        self.matcher = matcher
        self.num_prompt_tokens = num_prompt_tokens
        self.reasoning = reasoning  # the thinking part, which the constraint leaves free
        self.num_accepted = 0  # output tokens followed (the matcher accepts the answer's)
        # the last sampling row seen: the drafts it verified hold the outputs accepted with
        # them, which the next row's tokens no longer include
        self.last_row: ScheduledSeq | None = None

    @property
    def masked(self) -> bool:
        """Does the next token get the grammar's mask (not while the output thinks)?"""
        return self.reasoning is None or self.reasoning.answering


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
        starts = any(s.params.structured_outputs is not None for s in batch.started)
        if batch.guided or starts:
            masks = await self._worker.run(self._fill, batch)
        else:  # nothing to fill: only forget the sequences that left
            for seq_id in batch.released:
                self._seqs.pop(seq_id, None)
            return
        if batch.guided:
            await ctx.emit("out", masks)
        elif masks.seq_ids:
            raise GuideError(
                f"step {batch.step_id} masks constrained rows, but its batch is not guided"
            )

    def _fill(self, batch: StepBatch) -> StepMasks:
        seqs = self._seqs
        for seq_id in batch.released:
            seqs.pop(seq_id, None)
        for start in batch.started:
            spec = start.params.structured_outputs
            if spec is not None:
                tags = spec.after_reasoning
                seqs[start.seq_id] = _Guided(
                    self.grammars.matcher(spec),
                    len(start.prompt_token_ids),
                    ReasoningTracker(tags) if tags is not None else None,
                )
        rows = []
        for row in batch.rows:
            guided = seqs.get(row.seq_id) if row.sample else None
            if guided is not None:
                _catch_up(guided, row)
                guided.last_row = row
                if guided.masked:
                    rows.append(row)
        if not rows:
            return StepMasks(step_id=batch.step_id)
        bitmask = self.grammars.allocate_bitmask(sum(r.num_draft_tokens + 1 for r in rows))
        at = 0
        for row in rows:
            guided = seqs[row.seq_id]
            if row.num_draft_tokens:
                at = _fill_drafts(guided, row, bitmask, at)
                continue
            guided.matcher.fill(bitmask, at)
            reasoning = guided.reasoning
            if reasoning is not None and reasoning.may_open:
                allow_token(bitmask, at, reasoning.start_token)
            at += 1
        seq_ids = tuple(s.seq_id for s in rows for _ in range(s.num_draft_tokens + 1))
        return StepMasks(step_id=batch.step_id, seq_ids=seq_ids, bitmask=bitmask)


def has_guide(graph: ValidGraph) -> bool:
    """Whether `graph` computes grammar masks (else constrained requests are refused)."""
    return any(issubclass(bound.cls, Guide) for bound in graph.stages.values())


def _fill_drafts(guided: _Guided, row: ScheduledSeq, bitmask: torch.Tensor, at: int) -> int:
    """Fill the masks of a row's d + 1 positions from row `at` on (module docstring); the
    row after the last."""
    if guided.reasoning is not None:
        raise GuideError(f"seq {row.seq_id}: drafts for a constraint that follows reasoning")
    matcher = guided.matcher
    drafts = row.token_ids[len(row.token_ids) - row.num_draft_tokens :]
    followed = 0
    matcher.fill(bitmask, at)
    for j, draft in enumerate(drafts, start=1):
        if followed == j - 1 and not matcher.terminated and matcher.accept(draft):
            followed = j
            if not matcher.terminated:  # a stop token ends the sequence at its draw
                matcher.fill(bitmask, at + j)
                continue
        bitmask[at + j] = bitmask[at + j - 1]
    matcher.rollback(followed)
    return at + len(drafts) + 1


def _token_at(guided: _Guided, row: ScheduledSeq, position: int) -> int | None:
    """The token at `position` from this row's tokens, or from the drafts the last
    sampling row verified (those before this row's first position were accepted)."""
    offset = position - row.num_computed_tokens
    if 0 <= offset < len(row.token_ids):
        return row.token_ids[offset]
    last = guided.last_row
    if last is not None and offset < 0:
        offset = position - last.num_computed_tokens
        if 0 <= offset < len(last.token_ids):
            return last.token_ids[offset]
    return None


def _catch_up(guided: _Guided, row: ScheduledSeq) -> None:
    """Accept the outputs sampled since the matcher last moved (found in the row's tokens,
    or among the drafts accepted last step)."""
    while guided.num_accepted < row.num_output_tokens:
        position = guided.num_prompt_tokens + guided.num_accepted
        token = _token_at(guided, row, position)
        if token is None:
            raise GuideError(
                f"seq {row.seq_id}: output token {guided.num_accepted} is not in this step's "
                f"tokens (positions {row.num_computed_tokens}..."
                f"{row.num_computed_tokens + len(row.token_ids) - 1}) nor among the drafts "
                "accepted last step"
            )
        answer = guided.reasoning is None or guided.reasoning.accept(token)
        if answer and not guided.matcher.accept(token) and not guided.matcher.terminated:
            raise GuideError(f"seq {row.seq_id}: token {token} is not allowed by its grammar")
        guided.num_accepted += 1
