"""schedule: continuous batching. Owns every sequence and the KV block bookkeeping.

Each turn it takes what has arrived — step results first, so a finished step always frees
its credit before new work is considered, then stop-string finishes, then new requests and
aborts — and, while fewer than `max_inflight_steps` steps are in flight, sends the next
`StepBatch`, preceded on its own channel by the `ChoiceEvents` that detokenize must see
first (choices starting in that step, choices that ended unseen). The in-flight bound is
the credit that keeps the schedule → execute → sample → schedule cycle deadlock free
(every channel on it holds at least that many messages).
It returns once its request input has closed and no sequence or step is left.

An Abort normally arrives after its request (both travel the request path). With a
replicated stage upstream it may overtake it, so the ids of aborts for unknown requests
are remembered (the most recent `EARLY_ABORTS_KEPT`) and such a request is dropped on
arrival.

What must outlive a restart of the step loop (requests not yet started, ids, counters,
what downstream stages are owed, early aborts) is the scheduler's `Ledger`, which this
stage's context keeps for the next incarnation (`ctx.keep`).
"""

from __future__ import annotations

import msgspec

from flowllm.graph.stage import CLOSED, Stage, StageContext
from flowllm.messages import (
    Abort,
    ChoiceEvents,
    Finish,
    RequestError,
    StepBatch,
    StepTokens,
    TokenizedRequest,
    seq_ids_of,
)
from flowllm.scheduling.scheduler import Scheduler, SchedulerError
from flowllm.stages.services import EngineServices


class ScheduleParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_inflight_steps: int = 1
    # Schedule a sequence again while its sampled token is in flight, as a placeholder row
    # that execute fills from sample's `SampledIds` (sample.ids -> execute.sampled).
    async_scheduling: bool = False


class Schedule(Stage):
    inputs = {"step_results": StepTokens, "finishes": Finish, "requests": TokenizedRequest | Abort}
    optional_inputs = frozenset({"finishes"})  # a graph without stop strings (pooling)
    outputs = {
        "out": StepBatch,
        "guide": StepBatch,  # the batches that concern constrained sequences (see `run`)
        "choices": ChoiceEvents,
        "errors": RequestError,
    }
    optional_outputs = frozenset({"guide"})  # a graph without guide
    Params = ScheduleParams
    params: ScheduleParams
    credit_param = "max_inflight_steps"
    per_step_outputs = frozenset({"choices"})

    def __init__(self, params: ScheduleParams, services: EngineServices) -> None:
        super().__init__(params, services)
        config = services.config
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            services.num_blocks,
            services.max_model_len,
            async_scheduling=params.async_scheduling,
            speculative=config.speculative,
        )
        self._metrics = services.metrics

    def live_sequences(self) -> int:
        return self.scheduler.num_sequences

    def request_ids(self, message: object) -> tuple[str, ...]:
        """Per-step messages name sequences: their requests, as far as they are known."""
        seq_ids = seq_ids_of(message)
        if seq_ids is None:
            return super().request_ids(message)
        ids: dict[str, None] = {}
        for seq_id in seq_ids:
            seq = self.scheduler.get_sequence(seq_id)
            if seq is not None:
                ids[seq.request_id] = None
        return tuple(ids)

    async def run(self, ctx: StageContext) -> None:
        scheduler = self.scheduler
        inflight = 0
        intake_open = True
        # The first incarnation's ledger is kept by the context for every later one; an
        # incarnation that finds another's goes on from it (flowllm/scheduling/ledger.py).
        ledger = ctx.keep(scheduler.ledger)
        lost = scheduler.resume(ledger) if ledger is not scheduler.ledger else []
        for request_id in lost:
            await ctx.emit(
                "errors",
                RequestError(
                    request_id=request_id,
                    message="The engine's step loop failed and restarted; this request's "
                    "work was lost. Retrying it is safe.",
                    kind="internal",
                ),
            )
        to_guide = "guide" in ctx.output_ports
        constrained_before = False  # a constrained sequence was unfinished at the last batch
        while intake_open or inflight or scheduler.has_unfinished():
            if inflight < self.params.max_inflight_steps:
                with ctx.handling(None):
                    batch = scheduler.schedule()
                    events = scheduler.choice_events()
                if events is not None:
                    self._observe_started(events)
                    await ctx.emit("choices", events)  # before the batch: see ChoiceEvents
                if batch is not None:
                    if batch.rows.seq_ids:  # a step that only releases sequences computes nothing
                        self._metrics.iteration_tokens.observe(len(batch.rows.token_ids))
                    await ctx.emit("out", batch)
                    if to_guide:
                        # Guide follows constrained sequences only: a batch can start one,
                        # sample one, or release one (which the next batch after its finish
                        # does), so it gets every batch while one is unfinished, and the
                        # next; a step without any is not worth its wake-up.
                        constrained = scheduler.num_constrained > 0
                        if constrained or constrained_before:
                            await ctx.emit("guide", batch)
                        constrained_before = constrained
                    inflight += 1
                    continue
            port, message = await ctx.receive_any()
            if message is CLOSED:
                intake_open &= port != "requests"
                continue
            with ctx.handling(message):
                if isinstance(message, StepTokens):
                    generated = scheduler.num_generated
                    scheduler.apply(message)
                    inflight -= 1
                    self._metrics.generation_tokens.inc(scheduler.num_generated - generated)
                    if scheduler.verified:
                        self._metrics.observe_verified(scheduler.verified)
                elif isinstance(message, Finish):
                    scheduler.finish_sequence(message.seq_id, message.stop_reason)
                elif isinstance(message, Abort):
                    self._abort(message.request_id)
                else:
                    await self._add(message, ctx)
                self._metrics.observe_scheduler(scheduler.stats)

    def _abort(self, request_id: str) -> None:
        if self.scheduler.abort_request(request_id):
            return
        # Not running: not arrived yet (or just finished; remembering it then is harmless).
        self.scheduler.ledger.abort_before_arrival(request_id)

    async def _add(self, request: TokenizedRequest, ctx: StageContext) -> None:
        if self.scheduler.ledger.take_early_abort(request.request_id):
            return  # aborted before it arrived
        try:
            self.scheduler.add_request(request)
        except SchedulerError as e:
            await ctx.emit(
                "errors",
                RequestError(request_id=request.request_id, message=str(e)),
            )

    def _observe_started(self, events: ChoiceEvents) -> None:
        for choice in events.started:
            seq = self.scheduler.get_sequence(choice.seq.seq_id)
            if seq is not None and choice.seq.index == 0:
                queued = choice.scheduled_time - seq.arrival_time
                self._metrics.request_queue_time.observe(queued)
