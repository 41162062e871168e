"""The scheduler policy: which sequences compute which tokens in each model step.

One rule covers all work: each sequence's `num_computed_tokens` catches up with its
`num_tokens`. A step gives each chosen sequence a slice of that gap, so chunked prefill,
decodes, recompute after preemption and prefix-cache hits need no separate modes.

Per step (`schedule`), within `max_num_batched_tokens` tokens and `max_num_seqs` sequences:

1. Running sequences first, oldest first. Each gets its whole gap (1 token for a decode, a
   chunk for an unfinished prefill) but leaves one token of budget for every running
   sequence after it, so a long prompt never starves running decodes. When the pool is
   short, the youngest running sequence is preempted by recompute (blocks freed, back to
   the front of the waiting queue with nothing computed) until the allocation fits; if the
   youngest is the sequence being scheduled, it preempts itself.
2. Then, unless something was preempted this step, waiting sequences are admitted in
   arrival order (FCFS; the head blocks the rest) with the remaining budget. A sequence
   first adopts the prefix-cache hits of its tokens, then a long prompt takes whatever
   budget remains and continues next step; without chunked prefill
   (`enable_chunked_prefill` off: an encoder, which sees a prompt whole, or a pooler that
   reads every row) it waits for a step with room for all of it.

Async scheduling (`async_scheduling`, with more than one step in flight): a sequence whose
sampled token is still in flight is scheduled again at once, its next row computing that
token as a placeholder (`ScheduledRows.input_from`: execute reads the id where the model
runs). Its stop is then known one step late: a step may compute a row for a sequence its
previous token ended, which sample drops. Sequences under a grammar (whose masks need each
token) and those whose in-flight tokens reach their length limit wait for their tokens.

Speculative decoding (`speculative`, with one step in flight): `apply` keeps the drafts
that propose attached to each sequence's tokens, and a decoding sequence computes its last
token and then up to that many drafts, which sample verifies. The drafts cost their share
of the budget (the sequence still leaves one token for every later running sequence) and
never reach past its length limit or max_model_len. `apply` takes the accepted drafts and
the one token after them, and rolls `num_computed_tokens` back over the rejected ones:
their blocks stay the sequence's, rewritten by its next steps. Drafts are never hashed into
the prefix cache (only tokens in `token_ids` are). A step with more than
`disable_by_batch_size` running sequences schedules no drafts.

The running sequences are a table (flowllm.scheduling.running): from `COLUMNS_FROM` of
them on, `schedule` gives them their tokens in array operations, up to the first that the
budget cuts short or whose blocks preempt another (the rest go one by one, as admissions
and speculative steps always do), and `apply` advances a step's counters the same way when
its rows are still the sequences it sampled. Either way the steps are the same.

`apply` appends each step's sampled tokens and finishes sequences whose token carries a
finish reason (`SampledTokens.finishes`): the stop rule (flowllm.stopping) is applied once, by the
sample stage. The scheduler only guards its own invariant with the rule's length limit
(`output_limit`, the same function): a token past it ends the sequence as "length" even
without a reason (a sample stage built with another max_model_len), so no position at or
past max_model_len is ever scheduled. Finishing, aborting and stop strings free a
sequence's blocks at once; its id goes out in the next batch's `released`, and
`choice_events` tells detokenize of the ones that ended without a finishing token.
"""

from __future__ import annotations

import time
from collections import deque
from itertools import islice
from typing import NamedTuple, TypeVar

import msgspec
import numpy as np
import numpy.typing as npt

from flowllm.config import CacheConfig, ConfigError, SchedulerConfig, SpeculativeConfig
from flowllm.messages import (
    NO_FINISH,
    PLACEHOLDER_TOKEN,
    ChoiceEvents,
    ChoiceStart,
    SampledTokens,
    ScheduledRows,
    SeqStart,
    StepBatch,
    StepTokens,
    TokenizedRequest,
)
from flowllm.scheduling.kv_cache_manager import KVCacheManager, SeqBlocks
from flowllm.scheduling.ledger import Ledger
from flowllm.scheduling.running import RunningRows
from flowllm.scheduling.sequence import (
    FINISH_STATUSES,
    FinishedSeq,
    Sequence,
    SequenceStatus,
)
from flowllm.stopping import output_limit

# From this many running sequences on, the running part of a step is scheduled and
# applied as array operations (`_schedule_columns`, `_apply_columns`), whose fixed cost is
# more than a few sequences' one by one (benchmarks/README.md has the crossing point).
COLUMNS_FROM = 16

T = TypeVar("T")


class SchedulerError(ValueError):
    """A request the scheduler cannot hold (empty or too long prompt, duplicate id)."""


class SchedulerStats(msgspec.Struct, frozen=True, kw_only=True):
    """Gauges and cumulative counters for the metrics exporter."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # used blocks / total blocks; cached-but-free blocks are free
    prefix_cache_queries: int  # prompt tokens looked up at admission (cumulative)
    prefix_cache_hits: int  # of those, tokens found in the cache (cumulative)
    num_preemptions: int  # cumulative


class Scheduler:
    """Owns every sequence and the KV block bookkeeping; synchronous and I/O free.

    How the `schedule` stage drives it, message by message:

    * `TokenizedRequest` -> `add_request(req)`; a `SchedulerError` (empty or too long
      prompt, duplicate id) becomes the request's `RequestError`.
    * `Abort` -> `abort_request(abort.request_id)`; `Finish` -> `finish_sequence(seq_id,
      stop_reason)`. Both free blocks at once and return what finished (for metrics).
    * `StepTokens` -> `apply(tokens)`, returning the sequences that finished.
    * Whenever fewer than `max_inflight_steps` steps are in flight: `schedule()`, and send
      `choice_events()` (if not None) to detokenize and then the `StepBatch` (if not
      None). With more than one step in flight, a sequence whose sampled token is still
      in flight is scheduled with a placeholder (`async_scheduling`) or skipped until
      `apply` delivers it, while prompt chunks that do not sample keep going; steps must
      run, and their tokens be applied, in schedule order.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        async_scheduling: bool = False,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        if max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {max_model_len}")
        if num_blocks * cache_config.block_size < max_model_len:
            raise ConfigError(
                f"the KV cache ({num_blocks} blocks of {cache_config.block_size} tokens) "
                f"cannot hold one sequence of max_model_len={max_model_len} tokens"
            )
        self.chunked_prefill = scheduler_config.enable_chunked_prefill
        if not self.chunked_prefill and scheduler_config.max_num_batched_tokens < max_model_len:
            raise ConfigError(
                f"without chunked prefill a step must hold a whole prompt: "
                f"max_num_batched_tokens={scheduler_config.max_num_batched_tokens} is below "
                f"max_model_len={max_model_len}"
            )
        self.block_size = cache_config.block_size
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        # Every running sequence gets >= 1 token per step, so never run more than the budget.
        self.max_num_seqs = min(scheduler_config.max_num_seqs, self.max_num_batched_tokens)
        self.enable_prefix_caching = cache_config.enable_prefix_caching
        self.async_scheduling = async_scheduling
        self.columns_from = COLUMNS_FROM
        if speculative is not None and async_scheduling:
            raise ConfigError("speculative decoding runs with one step in flight, not async")
        self.speculative = speculative is not None
        # A step with more running sequences than this schedules no drafts.
        self.speculate_up_to = (
            self.max_num_seqs
            if speculative is None or speculative.disable_by_batch_size is None
            else speculative.disable_by_batch_size
        )
        self.kv = KVCacheManager(num_blocks, self.block_size, self.enable_prefix_caching)

        self.waiting: deque[Sequence] = deque()  # FCFS; preempted sequences at the front
        # admission order: oldest first, youngest last
        self.running = RunningRows(self.max_num_seqs)
        self._seqs: dict[int, Sequence] = {}  # every unfinished sequence by seq id
        self._requests: dict[str, list[Sequence]] = {}  # unfinished sequences per request
        self._num_constrained = 0  # unfinished sequences with structured outputs
        # For detokenize (`choice_events`): choices that started in the last batch.
        self._choice_starts: list[ChoiceStart] = []
        # step id -> the sequences it samples, in row order, until `apply` (oldest first)
        self._inflight: dict[int, _Sampling] = {}
        # What the rest of the graph is owed (releases, ended choices), the id counters and
        # the cumulative counters: what a fresh scheduler goes on from after a failure.
        self.ledger = Ledger()
        self.num_generated = 0  # tokens appended by `apply` (cumulative, this instance)
        # (drafts verified, drafts accepted) of each sequence that verified drafts in the
        # step the last `apply` took (for the metrics)
        self.verified: list[tuple[int, int]] = []

    # ------------------------------------------------------------------ input messages
    def add_request(self, request: TokenizedRequest) -> list[int]:
        """Queue a request as `n` sibling sequences (adjacent in the queue, so admitted
        together unless budget or blocks run out between them). Returns their seq ids."""
        prompt = request.prompt_token_ids
        params = request.params
        if not prompt:
            raise SchedulerError(f"request {request.request_id}: empty prompt")
        if len(prompt) > self.max_model_len:
            raise SchedulerError(
                f"request {request.request_id}: prompt of {len(prompt)} tokens exceeds "
                f"max_model_len={self.max_model_len}"
            )
        if request.request_id in self._requests:
            raise SchedulerError(f"request id {request.request_id!r} is already running")
        if params.n < 1:
            raise SchedulerError(f"request {request.request_id}: n must be >= 1")
        if params.max_tokens is not None and params.max_tokens < 1:
            raise SchedulerError(f"request {request.request_id}: max_tokens must be >= 1")
        # A full-length prompt still samples one token: the rule ends it there.
        limit = output_limit(params, len(prompt), self.max_model_len)
        use_cache = self.enable_prefix_caching and params.prompt_logprobs is None
        ledger = self.ledger
        seqs = []
        for index in range(params.n):
            seq = Sequence(
                seq_id=ledger.next_seq_id,
                request_id=request.request_id,
                index=index,
                prompt_token_ids=prompt,
                params=params,
                eos_token_ids=request.eos_token_ids,
                arrival_time=request.arrival_time,
                output_limit=limit,
                prompt_text=request.prompt_text,
                use_prefix_cache=use_cache,
                cache_salt=request.cache_salt,
                pooling=request.pooling,
            )
            if request.cache_salt is not None:
                self.kv.set_cache_salt(seq.seq_id, request.cache_salt)
            ledger.next_seq_id += 1
            self._seqs[seq.seq_id] = seq
            self._num_constrained += params.structured_outputs is not None
            self.waiting.append(seq)
            seqs.append(seq)
        self._requests[request.request_id] = seqs
        ledger.admitted(request)
        return [seq.seq_id for seq in seqs]

    def abort_request(self, request_id: str) -> list[FinishedSeq]:
        """Finish every unfinished sequence of the request as aborted, freeing its blocks
        now. Unknown (e.g. already finished) ids are ignored."""
        seqs = self._requests.get(request_id)
        if not seqs:
            return []
        self.ledger.choices_ended.extend(seq.seq_id for seq in seqs if seq.started)
        return [self._finish_now(seq, SequenceStatus.FINISHED_ABORTED, None) for seq in list(seqs)]

    def finish_sequence(self, seq_id: int, stop_reason: str | int | None) -> FinishedSeq | None:
        """A stop string ended this sequence: finish it as stopped and free its blocks now.
        Returns None if it already left."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return None
        return self._finish_now(seq, SequenceStatus.FINISHED_STOPPED, stop_reason)

    # ------------------------------------------------------------------ the step loop
    def schedule(self) -> StepBatch | None:
        """Choose the next step's work.

        Returns None when there is nothing to run and no released ids to deliver. A batch
        may carry no rows (`seqs == ()`) but only `released` ids: downstream stages should
        pass it along (dropping those sequences' state) without running the model.
        """
        # running rows chosen together, then (sequence, tokens to compute, its blocks) of
        # the rest in batch order
        rows: list[tuple[Sequence, int, SeqBlocks]] = []
        budget = self.max_num_batched_tokens
        bulk, next_row, budget, preempted = self._schedule_columns(budget)
        if next_row < len(self.running.seqs):
            budget, more = self._schedule_running(rows, budget, next_row)
            preempted |= more
        if not preempted:
            self._admit_waiting(rows, budget)
        if not len(bulk.num_new) and not rows and not self.ledger.released:
            return None
        return self._build_batch(bulk, rows)

    def apply(self, step: StepTokens) -> list[FinishedSeq]:
        """Append one step's sampled tokens and finish the sequences they end; returns those.
        Tokens for sequences that already left (aborted, stop string, ended by an earlier
        token), or that the step did not sample, are ignored. A pooling sequence's entry
        (pool's) only ends it: it generates nothing, so nothing is appended or counted in
        `num_generated`."""
        step_id = step.step_id
        self.ledger.step_applied(step_id)
        self.verified = []
        inflight = self._inflight.pop(step_id, None)
        if inflight is None:
            return []
        rows = self._aligned_rows(inflight, step.sampled)
        if rows is not None:
            return self._apply_columns(inflight.seqs, rows, step.sampled)
        return self._apply_one_by_one(inflight.seqs, step)

    def _aligned_rows(self, inflight: _Sampling, sampled: SampledTokens) -> Rows | None:
        """The running rows of a step's sequences if `_apply_columns` can take it (one
        token per sequence it sampled, in order, every one of them still running in the
        row it had, none dropping tokens or pooling); else None."""
        running = self.running
        if (
            self.speculative
            or len(inflight.seqs) < self.columns_from
            or inflight.generation != running.generation
            or len(sampled.seq_ids) != len(inflight.seqs)
        ):
            return None
        rows, c = inflight.rows, running.cols
        aligned = (
            c.seq_id[rows].tolist() == list(sampled.seq_ids)
            and not np.count_nonzero(c.num_dropped[rows])
            and not np.count_nonzero(c.pools[rows])
        )
        return rows if aligned else None

    def _apply_columns(
        self, seqs: list[Sequence], rows: Rows, sampled: SampledTokens
    ) -> list[FinishedSeq]:
        """`apply` for a step whose rows are its sequences in order (no drafts, none gone):
        the counters move in array operations; only the token lists and the finishes are
        handled one by one."""
        running, c = self.running, self.running.cols
        token_ids, finishes = sampled.token_ids, sampled.finishes
        c.num_pending[rows] -= 1
        for seq, token_id in zip(seqs, token_ids, strict=True):
            seq.token_ids.append(token_id)
        c.num_tokens[rows] += 1
        c.last_token[rows] = token_ids
        self.num_generated += len(token_ids)
        # the rule's length limit ends a sequence even if sample did not say so
        capped = (c.num_tokens[rows] >= c.end[rows]).nonzero()[0].tolist()
        if not finishes and not capped:
            return []
        finished: list[FinishedSeq] = []
        leaving: list[Sequence] = []
        for i in sorted({*finishes, *capped}):
            seq = seqs[i]
            reason, stop_reason = finishes.get(i, NO_FINISH)
            if reason is None:
                reason = "length"
                self.ledger.choices_ended.append(seq.seq_id)  # detokenize saw no finish
            self._finish(seq, FINISH_STATUSES[reason], stop_reason)
            finished.append(seq.to_finished())
            leaving.append(seq)
        running.remove(leaving)
        return finished

    def _apply_one_by_one(self, sampled: list[Sequence], step: StepTokens) -> list[FinishedSeq]:
        """`apply` for any step: each sequence's token looked up by its id when the rows
        are not its sequences in order."""
        rows = step.sampled
        seq_ids, token_ids, finishes = rows.seq_ids, rows.token_ids, rows.finishes
        # One row per sequence in schedule order, unless rows were dropped or drafts verified:
        # then each sequence's row (its last) is looked up.
        aligned = not self.speculative and len(seq_ids) == len(sampled)
        row_of: dict[int, int] | None = None
        runs = _runs(rows) if self.speculative else {}
        finished: list[FinishedSeq] = []
        leaving: list[Sequence] = []  # finished while running
        finished_waiting = False  # preempted while its token was in flight (overlap only)
        cells = self.running.cells
        pending_cells, dropped_cells = cells["num_pending"], cells["num_dropped"]
        num_tokens_cells, last_token_cells = cells["num_tokens"], cells["last_token"]
        for i, seq in enumerate(sampled):
            if seq.status > SequenceStatus.PREEMPTED:
                continue  # it left meanwhile
            if seq.running_in is None:  # preempted meanwhile: it holds its counters
                if seq.num_dropped:
                    seq.num_dropped -= 1
                    continue
                seq.num_pending -= 1
            else:
                if dropped_cells[seq.running_row]:
                    dropped_cells[seq.running_row] -= 1
                    continue
                pending_cells[seq.running_row] -= 1
            seq_id = seq.seq_id
            if aligned and seq_ids[i] == seq_id:
                row: int | None = i
            else:
                if row_of is None:
                    row_of = {sid: r for r, sid in enumerate(seq_ids)}
                row = row_of.get(seq_id)
            if row is None:
                # No token came for it: drop what later steps computed from it, and compute
                # its last token again next step, so it samples again instead of waiting.
                seq.num_dropped, seq.num_pending = seq.num_pending, 0
                seq.num_computed_tokens = min(seq.num_computed_tokens, len(seq.token_ids) - 1)
                continue
            tokens = seq.token_ids
            if seq.num_draft_tokens:
                accepted = runs[seq_id][:-1]
                self.verified.append((seq.num_draft_tokens, len(accepted)))
                seq.num_draft_tokens = 0
                tokens.extend(accepted)
                self.num_generated += len(accepted)
                # the rejected drafts' K/V are wrong: compute from the first of them again
                seq.num_computed_tokens = min(seq.num_computed_tokens, len(tokens))
            if self.speculative:
                seq.draft_token_ids = step.drafts.get(seq_id, ())
            if seq.pooling is None:
                tokens.append(token_ids[row])
                self.num_generated += 1
            if seq.running_in is not None:  # its token list's copies in the table
                num_tokens_cells[seq.running_row] = len(tokens)
                last_token_cells[seq.running_row] = tokens[-1]
            reason, stop_reason = finishes.get(row, NO_FINISH) if finishes else NO_FINISH
            if reason is None and len(tokens) - seq.num_prompt_tokens >= seq.output_limit:
                reason = "length"  # the rule's length limit, which sample should have said
                self.ledger.choices_ended.append(seq.seq_id)  # detokenize saw no finish
            if reason is not None:
                if seq.status is SequenceStatus.RUNNING:
                    leaving.append(seq)
                else:
                    finished_waiting = True
                self._finish(seq, FINISH_STATUSES[reason], stop_reason)
                finished.append(seq.to_finished())
        self.running.remove(leaving)
        if finished_waiting:
            self.waiting = deque(s for s in self.waiting if not s.is_finished)
        return finished

    def choice_events(self) -> ChoiceEvents | None:
        """What detokenize must learn before the batch `schedule()` just built: the choices
        it starts, and those that ended without a finishing token (aborted, or cut by the
        length guard). None when there is nothing to say."""
        ended = self.ledger.choices_ended
        if not self._choice_starts and not ended:
            return None
        events = ChoiceEvents(
            step_id=self.ledger.next_step_id - 1,
            started=tuple(self._choice_starts),
            ended=tuple(ended),
        )
        self._choice_starts.clear()
        ended.clear()
        return events

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @property
    def num_sequences(self) -> int:
        """Unfinished sequences, waiting or running."""
        return len(self._seqs)

    @property
    def num_constrained(self) -> int:
        """Unfinished sequences with structured outputs, waiting or running."""
        return self._num_constrained

    def resume(self, ledger: Ledger) -> list[str]:
        """Go on from a failed step loop's record (call on a fresh scheduler): its
        requests that never started run here as if nothing happened, ids keep counting
        up, the counters go on, and downstream stages are told to drop every sequence of
        the old loop in the next batch. Returns the ids of the requests whose sequences
        had started: their work is lost."""
        requeue, lost = ledger.after_failure()
        self.ledger = ledger
        for request in requeue:
            self.add_request(request)
        return lost

    @property
    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.ledger.prefix_cache_queries,
            prefix_cache_hits=self.ledger.prefix_cache_hits,
            num_preemptions=self.ledger.num_preemptions,
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (e.g. after a weight reload); only when idle."""
        return self.kv.pool.reset_prefix_cache()

    def get_sequence(self, seq_id: int) -> Sequence | None:
        """An unfinished sequence, for inspection (the scheduler stays its only editor)."""
        return self._seqs.get(seq_id)

    # ------------------------------------------------------------------ policy helpers
    def _schedule_columns(self, budget: int) -> tuple[_Bulk, int, int, bool]:
        """Give running sequences their whole gap at once, as `_schedule_running` would one
        by one, from the oldest up to the first that the budget cuts short or whose blocks
        preempt a younger one. Returns those rows, the first row left to
        `_schedule_running`, the budget left and whether anything was preempted.
        Speculative decoding (whose drafts change each row's share) leaves every row to it."""
        running = self.running
        n = len(running.seqs)
        if n < self.columns_from or self.speculative:
            return _NO_BULK, 0, budget, False
        c = running.cols
        pending = c.num_pending[:n]
        num_tokens = c.num_tokens[:n] + pending
        computed = c.num_computed_tokens[:n]
        # (computed <= num_tokens and < max_model_len: no row's gap is negative)
        num_new = np.minimum(num_tokens, self.max_model_len) - computed
        if np.count_nonzero(pending):
            # ahead of its tokens only as a placeholder, and never past its last one
            ready = pending == 0
            if self.async_scheduling:
                ready |= c.runs_ahead[:n] & (num_tokens < c.end[:n])
            num_new *= ready
        stop = n
        total = int(num_new.sum())
        if total + n - 1 > budget:  # may cut one short: every later one keeps a token
            fits = np.cumsum(num_new) <= budget - np.arange(n - 1, -1, -1)
            stop = n if np.count_nonzero(fits) == n else int(np.argmin(fits))
        take = num_new[:stop].nonzero()[0]
        preempted = False
        crossing = (computed[:stop] + num_new[:stop] > c.fast_limit[:stop]).nonzero()[0]
        if len(crossing):  # the rows that need blocks: at once, if the pool has them all
            seqs = running.seqs
            grown = self.kv.allocate_running(
                c.seq_id[crossing].tolist(),
                [seqs[row].token_ids for row in crossing.tolist()],
                (computed[crossing] + num_new[crossing]).tolist(),
            )
            if grown is not None:
                c.fast_limit[crossing] = [rec.fast_limit for rec in grown]
                crossing = crossing[:0]
        for row in crossing.tolist():
            num_preemptions = self.ledger.num_preemptions
            rec = self._allocate_or_preempt(running[row], int(computed[row]), int(num_new[row]))
            if self.ledger.num_preemptions != num_preemptions:
                preempted = True
                stop = row + 1 if rec is not None else row
                take = take[take < stop]
                break
        rows: Rows = slice(0, stop) if len(take) == stop else take
        chosen = num_new[rows]
        budget -= total if stop == n and not preempted else int(chosen.sum())
        return _Bulk(rows, chosen), stop, budget, preempted

    def _schedule_running(
        self, rows: list[tuple[Sequence, int, SeqBlocks]], budget: int, first_row: int
    ) -> tuple[int, bool]:
        """Give running sequences from `first_row` on their tokens one by one, oldest
        first, preempting the youngest when blocks run out. Returns the budget left and
        whether anything was preempted."""
        running = self.running
        blocks, cells = running.blocks, running.cells
        pending_of = cells["num_pending"]
        computed_of = cells["num_computed_tokens"]
        fast_limit_of = cells["fast_limit"]
        max_model_len = self.max_model_len
        ahead = self.async_scheduling
        num_running = len(running.seqs)
        speculate = num_running <= self.speculate_up_to
        preempted = False
        # Preemption only pops from the end, which the iterator sees: no later sequence is
        # visited once preempted.
        for row, seq in enumerate(islice(running.seqs, first_row, None), first_row):
            num_tokens = len(seq.token_ids)
            pending = pending_of[row]
            if pending:
                # Ahead of its tokens only as a placeholder, and never past its last one.
                num_tokens += pending
                if not (
                    ahead
                    and seq.runs_ahead
                    and num_tokens - seq.num_prompt_tokens < seq.output_limit
                ):
                    continue
            if num_tokens > max_model_len:
                num_tokens = max_model_len
            # Every later running sequence keeps one token of the budget.
            room = budget - (num_running - row - 1)
            computed = computed_of[row]
            num_new = num_tokens - computed
            if num_new > room:
                num_new = room
            if num_new <= 0:
                continue
            if seq.draft_token_ids:
                drafts, seq.draft_token_ids = seq.draft_token_ids, ()
                if speculate and num_new == 1 and not pending and seq.params.takes_drafts:
                    # its last token and d drafts, whose d + 1 outputs stay within its
                    # length limit (and so every position below max_model_len)
                    limit = seq.output_limit - (num_tokens - seq.num_prompt_tokens) - 1
                    d = int(min(len(drafts), room - 1, limit))
                    if d > 0:
                        seq.draft_token_ids = drafts[:d]
                        num_new += d
            if computed + num_new <= fast_limit_of[row]:
                rows.append((seq, num_new, blocks[row]))
            else:
                num_preemptions = self.ledger.num_preemptions
                rec = self._allocate_or_preempt(seq, computed, num_new)
                preempted |= self.ledger.num_preemptions != num_preemptions
                num_running = len(running.seqs)
                if rec is None:  # preempted itself (which drops its drafts)
                    continue
                rows.append((seq, num_new, rec))
            budget -= num_new
        return budget, preempted

    def _allocate_or_preempt(self, seq: Sequence, computed: int, num_new: int) -> SeqBlocks | None:
        """Allocate `num_new` slots after its `computed` tokens for a running sequence,
        preempting the youngest running sequences until it fits. Returns None if `seq`
        itself had to be preempted."""
        running = self.running
        allocate = self.kv.allocate_slots
        while True:
            rec = allocate(seq.seq_id, seq.token_ids, computed, num_new)
            if rec is not None:
                running.cells["fast_limit"][seq.running_row] = rec.fast_limit
                return rec
            victim = running[-1]
            if victim is seq and len(running) == 1:
                # __init__ checked that one max_model_len sequence fits the pool, and only
                # running sequences hold blocks: reaching here is a bookkeeping bug.
                raise RuntimeError(f"sequence {seq.seq_id} alone does not fit the KV cache")
            running.pop()
            self._preempt(victim)
            if victim is seq:
                return None

    def _admit_waiting(self, rows: list[tuple[Sequence, int, SeqBlocks]], budget: int) -> None:
        """Admit waiting sequences FCFS with the remaining budget; stop at the first that
        does not fit (no preemption for admission)."""
        waiting, running, kv = self.waiting, self.running, self.kv
        while waiting and budget > 0 and len(running.seqs) < self.max_num_seqs:
            seq = waiting[0]
            if seq.num_pending or seq.num_dropped:  # preempted while a token is in flight
                break
            num_tokens = min(seq.num_tokens, self.max_model_len)
            hits = kv.find_cached_prefix(seq.seq_id, seq.token_ids) if seq.use_prefix_cache else []
            num_hit_tokens = len(hits) * self.block_size
            num_new = min(num_tokens - num_hit_tokens, budget)
            if num_new <= 0 or (not self.chunked_prefill and num_new < num_tokens - num_hit_tokens):
                break
            rec = kv.allocate_slots(seq.seq_id, seq.token_ids, 0, num_new, hits)
            if rec is None:
                break
            waiting.popleft()
            if seq.use_prefix_cache:
                self.ledger.prefix_cache_queries += num_tokens
                self.ledger.prefix_cache_hits += num_hit_tokens
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = num_hit_tokens
            seq.num_computed_tokens = num_hit_tokens
            seq.status = SequenceStatus.RUNNING
            running.append(seq, rec)
            rows.append((seq, num_new, rec))
            budget -= num_new

    def _build_batch(self, bulk: _Bulk, rows: list[tuple[Sequence, int, SeqBlocks]]) -> StepBatch:
        """Turn the chosen rows (`bulk`'s first) into the step message and advance
        `num_computed_tokens` (the K/V of these tokens will be in the cache once the step
        runs)."""
        ledger = self.ledger
        step_id = ledger.next_step_id
        ledger.next_step_id += 1
        inflight_from = next(iter(self._inflight), step_id)
        (
            seq_ids,
            query_lens,
            token_ids,
            computed,
            block_tables,
            samples,
            num_output_tokens,
            input_from,
            prompt_logits_for,
            reads_sampled,
            sampling,
            bulk_sampling,
            guided,
        ) = self._bulk_columns(bulk, step_id) if len(bulk.num_new) else _no_columns()
        later_rows: list[int] = []  # the running rows of the sequences sampled below
        num_draft_tokens: dict[int, int] = {}
        started: list[SeqStart] = []
        any_constrained = self._num_constrained > 0
        # every sequence here runs: its counters are read and written in its row
        cells = self.running.cells
        pending_col, computed_col = cells["num_pending"], cells["num_computed_tokens"]
        wants_col = cells["wants_prompt_logits"]
        sampled_step, sampled_row = cells["sampled_step"], cells["sampled_row"]
        for seq, num_new, blocks in rows:
            row = seq.running_row
            tokens = seq.token_ids
            pending = pending_col[row]
            num_tokens = len(tokens) + pending
            start = computed_col[row]
            end = start + num_new
            drafts = seq.draft_token_ids
            sample = end == num_tokens + len(drafts)
            if drafts:  # its last token, then the drafts to verify
                num_draft_tokens[len(seq_ids)] = len(drafts)
                token_ids.append(tokens[-1])
                token_ids.extend(drafts)
                seq.draft_token_ids, seq.num_draft_tokens = (), len(drafts)
            elif pending:  # the token in flight, as a placeholder (one row)
                from_step = sampled_step[row]
                input_from[len(seq_ids)] = (from_step, sampled_row[row])
                reads_sampled.add(from_step)
                token_ids.append(PLACEHOLDER_TOKEN)
            elif num_new == 1:
                token_ids.append(tokens[start])
            else:
                token_ids.extend(tokens[start:end])
            seq_ids.append(seq.seq_id)
            query_lens.append(num_new)
            computed.append(start)
            block_tables.append(blocks.table)
            samples.append(sample)
            num_output_tokens.append(num_tokens - seq.num_prompt_tokens)
            computed_col[row] = end
            if wants_col[row]:
                prompt_logits_for.append(seq.seq_id)
                wants_col[row] = not sample
            if sample:
                pending_col[row] = pending + 1
                sampled_step[row] = step_id
                sampled_row[row] = len(sampling)
                sampling.append(seq)
                later_rows.append(row)
                if any_constrained and seq.params.structured_outputs is not None:
                    guided = True
            if not seq.started:
                seq.started = True
                seq_start = seq.to_start()
                started.append(seq_start)
                self._choice_starts.append(seq.to_choice_start(seq_start, time.monotonic()))
                ledger.seq_started(seq.request_id, seq.seq_id)
        if sampling:
            self._inflight[step_id] = _Sampling(
                sampling, bulk_sampling, later_rows, self.running.generation
            )
        released = tuple(ledger.released)
        ledger.released.clear()
        if released:
            ledger.releases_in_flight[step_id] = released
        return StepBatch(
            step_id=step_id,
            rows=ScheduledRows(
                seq_ids=tuple(seq_ids),
                query_lens=tuple(query_lens),
                token_ids=tuple(token_ids),
                num_computed_tokens=tuple(computed),
                block_tables=tuple(block_tables),
                sample=tuple(samples),
                num_output_tokens=tuple(num_output_tokens),
                input_from=input_from,
                num_draft_tokens=num_draft_tokens,
            ),
            started=tuple(started),
            released=released,
            prompt_logits_for=tuple(prompt_logits_for),
            reads_sampled=tuple(sorted(reads_sampled)),
            inflight_from=inflight_from,
            guided=guided,
        )

    def _bulk_columns(self, bulk: _Bulk, step_id: int) -> _Columns:
        """`_build_batch`'s columns for the rows `_schedule_columns` chose, read from and
        written to the running table in array operations."""
        running, rows, num_new = self.running, bulk.rows, bulk.num_new
        c, seqs, n = running.cols, running.seqs, len(num_new)
        start = c.num_computed_tokens[rows]
        computed = start.tolist()
        pending = c.num_pending[rows]
        end = start + num_new
        num_tokens = c.num_tokens[rows] + pending
        sample = end == num_tokens
        all_sample = np.count_nonzero(sample) == n
        # a decode row computes its last token, or the one in flight as a placeholder
        placeholder = pending > 0
        any_placeholder = np.count_nonzero(placeholder) > 0
        token_ids: list[int] = []
        if all_sample and not np.count_nonzero(num_new - 1):  # decodes only
            last = c.last_token[rows]
            token_ids = (
                np.where(placeholder, PLACEHOLDER_TOKEN, last) if any_placeholder else last
            ).tolist()
        else:
            for seq, a, b, ahead in zip(
                _pick_list(seqs, rows), computed, end.tolist(), placeholder.tolist(), strict=True
            ):
                token_ids.extend((PLACEHOLDER_TOKEN,) if ahead else seq.token_ids[a:b])
        input_from: dict[int, tuple[int, int]] = {}
        reads_sampled: set[int] = set()
        if any_placeholder:
            at = placeholder.nonzero()[0]
            steps = c.sampled_step[_pick(rows, at)].tolist()
            from_rows = c.sampled_row[_pick(rows, at)].tolist()
            input_from = dict(zip(at.tolist(), zip(steps, from_rows, strict=True), strict=True))
            reads_sampled = set(steps)
        wants = c.wants_prompt_logits[rows]
        prompt_logits_for: list[int] = []
        if np.count_nonzero(wants):
            prompt_logits_for = c.seq_id[_pick(rows, wants.nonzero()[0])].tolist()
            c.wants_prompt_logits[rows] = wants & ~sample
        c.num_computed_tokens[rows] = end
        sampling_rows = rows if all_sample else _pick(rows, sample.nonzero()[0])
        c.num_pending[sampling_rows] += 1
        c.sampled_step[sampling_rows] = step_id
        sampling = _pick_list(seqs, sampling_rows)
        c.sampled_row[sampling_rows] = np.arange(len(sampling))
        return _Columns(
            seq_ids=c.seq_id[rows].tolist(),
            query_lens=num_new.tolist(),
            token_ids=token_ids,
            computed=computed,
            block_tables=[b.table for b in _pick_list(running.blocks, rows)],
            samples=sample.tolist(),
            num_output_tokens=(num_tokens - c.num_prompt[rows]).tolist(),
            input_from=input_from,
            prompt_logits_for=prompt_logits_for,
            reads_sampled=reads_sampled,
            sampling=sampling,
            sampling_rows=sampling_rows,
            guided=self._num_constrained > 0
            and bool(np.count_nonzero(c.constrained[sampling_rows])),
        )

    def _preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: free every block; recompute all tokens on readmission
        (prefix-cache hits make that cheap). Not `started` again downstream."""
        self.kv.free(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        seq.draft_token_ids = ()
        seq.status = SequenceStatus.PREEMPTED
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
        self.ledger.num_preemptions += 1

    def _finish(self, seq: Sequence, status: SequenceStatus, stop_reason: str | int | None) -> None:
        """Mark finished and free blocks now; the caller removes it from running/waiting."""
        seq.status = status
        seq.stop_reason = stop_reason
        self.kv.remove(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        del self._seqs[seq.seq_id]
        self._num_constrained -= seq.params.structured_outputs is not None
        siblings = self._requests.get(seq.request_id)
        if siblings is not None:
            siblings.remove(seq)
            if not siblings:
                del self._requests[seq.request_id]
                self.ledger.request_finished(seq.request_id)
        if seq.started:
            self.ledger.seq_finished(seq.seq_id)
            self.ledger.released.append(seq.seq_id)

    def _finish_now(
        self, seq: Sequence, status: SequenceStatus, stop_reason: str | int | None
    ) -> FinishedSeq:
        """Finish one sequence outside `apply` (abort, stop string)."""
        was_running = seq.status is SequenceStatus.RUNNING
        self._finish(seq, status, stop_reason)
        if was_running:
            self.running.remove([seq])
        else:
            self.waiting.remove(seq)
        return seq.to_finished()


# Rows of the running table, ascending: the first ones as a slice (the common case, which
# indexes a column as a view), or their indices.
Rows = slice | npt.NDArray[np.int64]


def _pick(rows: Rows, at: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """The rows at positions `at` of `rows`."""
    return at if isinstance(rows, slice) else rows[at]


def _pick_list(items: list[T], rows: Rows) -> list[T]:
    """The entries of a table's list (sequences, blocks) at `rows`."""
    if isinstance(rows, slice):
        return items[rows]
    return [items[row] for row in rows.tolist()]


class _Bulk(NamedTuple):
    """Running rows chosen together (`Scheduler._schedule_columns`), in row order."""

    rows: Rows  # their rows in the running table
    num_new: npt.NDArray[np.int64]  # tokens each computes


_NO_BULK = _Bulk(slice(0, 0), np.zeros(0, np.int64))


class _Sampling(NamedTuple):
    """The sequences a step in flight samples, in its sampling rows' order."""

    seqs: list[Sequence]
    # their rows in the running table when it was scheduled: those chosen together, then
    # the others'
    bulk_rows: Rows
    later_rows: list[int]
    generation: int  # the running table's, then: the rows hold while it is unchanged

    @property
    def rows(self) -> Rows:
        if not self.later_rows:
            return self.bulk_rows
        bulk = self.bulk_rows
        first = np.arange(bulk.stop) if isinstance(bulk, slice) else bulk
        return np.concatenate((first, np.array(self.later_rows, np.int64)))


class _Columns(NamedTuple):
    """A step message's columns as `_build_batch` fills them, with the sequences that
    sample (and their running rows)."""

    seq_ids: list[int]
    query_lens: list[int]
    token_ids: list[int]
    computed: list[int]
    block_tables: list[tuple[int, ...]]
    samples: list[bool]
    num_output_tokens: list[int]
    input_from: dict[int, tuple[int, int]]
    prompt_logits_for: list[int]
    reads_sampled: set[int]
    sampling: list[Sequence]
    sampling_rows: Rows
    guided: bool


def _no_columns() -> _Columns:
    return _Columns([], [], [], [], [], [], [], {}, [], set(), [], slice(0, 0), False)


def _runs(rows: SampledTokens) -> dict[int, list[int]]:
    """Each sequence's token ids in a step, in order (several for one that verified drafts)."""
    runs: dict[int, list[int]] = {}
    for seq_id, token_id in zip(rows.seq_ids, rows.token_ids, strict=True):
        runs.setdefault(seq_id, []).append(token_id)
    return runs
