"""sample: one batched sampling call per step, in its worker thread.

It learns each sequence's parameters from `StepBatch.started` (and forgets it on
`StepBatch.released`), decides every sampled token's finish reason with the stop rule
(flowllm.stopping), and sends the same `StepTokens` to schedule (which appends
them) and detokenize (which turns them into text). With `ids` connected it hands the
step's sampled ids, still on the model's device, to execute (`SampledIds`), where the next
step's placeholder rows read them (async scheduling): as soon as they are chosen, before
the host waits for them, so the device runs the next step while the host copies these.

A step whose batch verifies drafts (speculative decoding) is sampled position by position
(`Sampler.verify`): each verifying sequence sends its accepted drafts and one token more.
Such a step sends no ids (speculative decoding runs with one step in flight).

With the guide stage connected to `masks`, it joins the logits of each step whose batch is
`guided` with the step's `StepMasks` (both come from one `StepBatch`, in step order; other
steps have no masks) and samples constrained rows from the tokens their grammar allows,
each verified position under its own mask. Without it, it samples from the logits alone.

A front process imports this module to check the graph's edges, and loads no torch: the
sampler (torch) is imported where the stage is built, in the process that runs it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import accumulate, compress
from time import perf_counter
from typing import TYPE_CHECKING

from flowllm.graph.stage import CLOSED, NoParams, PerMessageStage, StageContext
from flowllm.messages import (
    SampledIds,
    SampledTokens,
    ScheduledRows,
    StepLogits,
    StepMasks,
    StepTokens,
    TokenLogprobs,
)
from flowllm.stages.services import EngineServices

if TYPE_CHECKING:
    from flowllm.sampling.sampler import Chosen


class SampleError(RuntimeError):
    """The logits and masks of one step did not arrive together (a bug upstream)."""


class Sample(PerMessageStage):
    inputs = {"in": StepLogits, "masks": StepMasks}
    optional_inputs = frozenset({"masks"})
    outputs = {"out": StepTokens, "ids": SampledIds}
    optional_outputs = frozenset({"ids"})
    joins_inputs = True  # a guided step's logits with its masks, each input in step order

    def __init__(self, params: NoParams, services: EngineServices) -> None:
        from flowllm.sampling.sampler import Sampler

        super().__init__(params, services)
        self.sampler = Sampler(
            seed=services.config.model.seed,
            max_model_len=services.max_model_len,
            device=services.model_device(),
        )
        self._worker = services.step_thread("sample")

    def live_sequences(self) -> int:
        return len(self.sampler)

    async def run(self, ctx: StageContext) -> None:
        if "masks" not in ctx.input_ports:
            await super().run(ctx)
            return
        early: deque[StepMasks] = deque()  # masks that came before their step's logits
        while True:
            # Either input ending ends the step loop's work here: the masks' end is what
            # closes this stage's `ids` (and so execute's input) in an async graph.
            port, message = await ctx.receive_any("in", "masks")
            if message is CLOSED:
                return
            if port == "masks":
                self._received(message, ctx)
                early.append(message)
                continue
            step, step_wait = message, ctx.last_wait
            masks = None
            if step.batch.guided:
                while not early:
                    _, message = await ctx.receive_any("masks")
                    if message is CLOSED:
                        raise SampleError(
                            f"step {step.batch.step_id} is guided, but its masks' input closed"
                        )
                    self._received(message, ctx)
                    early.append(message)
                masks = early.popleft()
            with ctx.handling(step, step_wait):
                if masks is not None and masks.step_id != step.batch.step_id:
                    raise SampleError(
                        f"step {step.batch.step_id}'s logits met the masks of step {masks.step_id}"
                    )
                await self.sample_step(step, masks, ctx)

    @staticmethod
    def _received(masks: StepMasks, ctx: StageContext) -> None:
        """A span marks the masks' receipt (just taken by `receive_any`), so a trace shows
        when they came."""
        ctx.spans.record(masks, perf_counter(), ctx.last_wait, observed=False)

    async def handle(self, step: StepLogits, ctx: StageContext) -> None:
        await self.sample_step(step, None, ctx)

    async def sample_step(
        self, step: StepLogits, masks: StepMasks | None, ctx: StageContext
    ) -> None:
        """Sample one step (under its grammar masks, if any) and send its tokens. With `ids`
        connected, the ids go out as soon as they are chosen on the device, before the
        host waits for them, so that the next step can run meanwhile (async scheduling)."""
        rows, vocab = step.logits.shape
        size = (rows.bit_length(), vocab, masks is not None, bool(step.prompt_logits))
        run = self._worker.run
        if "ids" not in ctx.output_ports:
            tokens = await run(self._sample, step, masks, size=size)
        else:
            chosen = await run(self._choose, step, masks, size=(*size, "choose"))
            if not isinstance(chosen, SampledTokens):  # chosen on the device, not yet on the host
                await ctx.emit("ids", SampledIds(step_id=step.batch.step_id, ids=chosen.ids))
            tokens = await run(self._finish, step, chosen, size=(*size, "finish"))
        await ctx.emit("out", tokens)

    def _sample(self, step: StepLogits, masks: StepMasks | None) -> StepTokens:
        return self._finish(step, self._choose(step, masks))

    def _choose(self, step: StepLogits, masks: StepMasks | None) -> Chosen | SampledTokens:
        """The step's tokens chosen on the device (`Sampler.choose`); a step that verifies
        drafts, whose positions are decided on the host, is sampled whole here."""
        batch = step.batch
        sampler = self.sampler
        for seq_id in batch.released:
            sampler.release(seq_id)
        for start in batch.started:
            sampler.start(start)
        rows = batch.rows
        samples = rows.sample
        if all(samples):
            seq_ids, num_output_tokens = rows.seq_ids, rows.num_output_tokens
        else:
            seq_ids = tuple(compress(rows.seq_ids, samples))
            num_output_tokens = tuple(compress(rows.num_output_tokens, samples))
        drafts = _drafts(rows) if rows.num_draft_tokens else None
        allowed = None
        if masks is not None and masks.seq_ids:
            allowed = (_logits_rows(seq_ids, drafts, masks.seq_ids), masks.bitmask)
        if drafts is not None:
            return sampler.verify(seq_ids, drafts, step.logits, num_output_tokens, allowed)
        if seq_ids:
            return sampler.choose(seq_ids, step.logits, num_output_tokens, allowed)
        return SampledTokens()

    def _finish(self, step: StepLogits, chosen: Chosen | SampledTokens) -> StepTokens:
        """The step's tokens on the host (`Sampler.finish`), with its prompt logprobs."""
        batch = step.batch
        sampler = self.sampler
        sampled = chosen if isinstance(chosen, SampledTokens) else sampler.finish(chosen)
        prompt_logprobs: dict[int, tuple[TokenLogprobs | None, ...]] = {}
        if step.prompt_logits:
            computed = dict(zip(batch.rows.seq_ids, batch.rows.num_computed_tokens, strict=True))
            for seq_id, logits in step.prompt_logits.items():
                prompt_logprobs[seq_id] = sampler.prompt_logprobs(seq_id, computed[seq_id], logits)
        return StepTokens(step_id=batch.step_id, sampled=sampled, prompt_logprobs=prompt_logprobs)


def _drafts(rows: ScheduledRows) -> list[tuple[int, ...]]:
    """The drafts each sampling row verifies (none for most): the last tokens of its row."""
    ends = accumulate(rows.query_lens)
    return [
        rows.token_ids[end - rows.num_draft_tokens.get(row, 0) : end]
        for row, (end, sample) in enumerate(zip(ends, rows.sample, strict=True))
        if sample
    ]


def _logits_rows(
    seq_ids: Sequence[int], drafts: list[tuple[int, ...]] | None, masked: tuple[int, ...]
) -> list[int]:
    """The logits row of each mask row: a sequence's rows follow one another, one per
    position it samples (its drafts, if any, and one more), and so do its masks."""
    if drafts is None:
        first_row = {seq_id: row for row, seq_id in enumerate(seq_ids)}
    else:
        starts = accumulate((len(d) + 1 for d in drafts), initial=0)  # one more: the total
        first_row = dict(zip(seq_ids, starts, strict=False))
    rows: list[int] = []
    previous, position = None, 0
    for seq_id in masked:
        position = position + 1 if seq_id == previous else 0
        previous = seq_id
        rows.append(first_row[seq_id] + position)
    return rows
