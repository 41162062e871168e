"""One sequence (one generated choice of a request) and its life-cycle states.

The scheduler owns every `Sequence`: no other module edits one. Downstream stages keep
read-only copies of what they use (`SeqStart` for the step loop, `ChoiceStart` for
detokenize) and learn its progress from the step's `ScheduledRows`, so the fields here can
change without touching any channel contract.

The single scheduling rule: `num_computed_tokens` (tokens whose K/V are in the cache)
catches up with `num_tokens` (prompt + outputs so far). A prefill chunk, a decode, a
recompute after preemption and a prefix-cache hit are all just different values of that gap.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Generic, TypeVar

import msgspec

from flowllm.messages import ChoiceStart, FinishReason, PoolingParams, SamplingParams, SeqStart
from flowllm.scheduling.running import MOVED, RunningRows

T = TypeVar("T", int, bool)


class SequenceStatus(enum.IntEnum):
    """Where a sequence is in its life. Everything after PREEMPTED is finished."""

    WAITING = 0  # queued, holds no blocks
    RUNNING = 1  # holds blocks, scheduled every step until it finishes or is preempted
    PREEMPTED = 2  # blocks freed, back at the front of the waiting queue to recompute
    FINISHED_STOPPED = 3  # EOS, a stop token id or a stop string
    FINISHED_LENGTH_CAPPED = 4  # max_tokens or max_model_len
    FINISHED_ABORTED = 5  # client gone or API cancel

    @property
    def is_finished(self) -> bool:
        """One comparison, thanks to the ordering above."""
        return self > SequenceStatus.PREEMPTED


FINISH_REASONS: dict[SequenceStatus, FinishReason] = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}

FINISH_STATUSES: dict[FinishReason, SequenceStatus] = {
    reason: status for status, reason in FINISH_REASONS.items()
}


class FinishedSeq(msgspec.Struct, frozen=True, kw_only=True):
    """A sequence that left the running set (what `Scheduler.apply` reports for metrics)."""

    seq_id: int
    request_id: str
    index: int
    finish_reason: FinishReason
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens served by the prefix cache at first admission


class _StepCounter(Generic[T]):
    """A step counter of a `Sequence`: its own `_<name>` attribute while it waits, the
    cell of its row in the running table while it runs (one place at a time)."""

    def __init__(self, kind: Callable[[int], T]) -> None:
        self.kind: Callable[[int], T] = kind

    def __set_name__(self, owner: type, name: str) -> None:
        self.column = name
        self.held = "_" + name

    def __get__(self, seq: Sequence, owner: type | None = None) -> T:
        rows = seq.running_in
        if rows is None:
            held: T = getattr(seq, self.held)
            return held
        return self.kind(rows.cells[self.column][seq.running_row])

    def __set__(self, seq: Sequence, value: T) -> None:
        rows = seq.running_in
        if rows is None:
            setattr(seq, self.held, value)
        else:
            rows.cells[self.column][seq.running_row] = value


class Sequence:
    """The scheduler's record of one sequence.

    Invariants: `0 <= num_computed_tokens <= num_tokens`; computed positions stay below
    max_model_len (the scheduler guards it); `token_ids[:num_prompt_tokens]` is the prompt.
    """

    __slots__ = (
        "_num_computed_tokens",
        "_num_dropped",
        "_num_pending",
        "_wants_prompt_logits",
        "arrival_time",
        "cache_salt",
        "draft_token_ids",
        "eos_token_ids",
        "index",
        "num_cached_tokens",
        "num_draft_tokens",
        "num_prompt_tokens",
        "output_limit",
        "params",
        "pooling",
        "prompt_text",
        "prompt_token_ids",
        "request_id",
        "running_in",
        "running_row",
        "runs_ahead",
        "seq_id",
        "started",
        "status",
        "stop_reason",
        "token_ids",
        "use_prefix_cache",
    )

    def __init__(
        self,
        *,
        seq_id: int,
        request_id: str,
        index: int,
        prompt_token_ids: tuple[int, ...],
        params: SamplingParams,
        eos_token_ids: tuple[int, ...],
        arrival_time: float,
        output_limit: float,
        prompt_text: str | None = None,
        use_prefix_cache: bool = True,
        cache_salt: str | None = None,
        pooling: PoolingParams | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = arrival_time
        # Outputs at which the stop rule's length limit ends it (flowllm.stopping).
        self.output_limit = output_limit
        self.prompt_text = prompt_text
        # Requests asking for prompt logprobs compute every prompt token, so never reuse.
        self.use_prefix_cache = use_prefix_cache
        self.cache_salt = cache_salt  # its request's: prefix-cache blocks it may share
        self.pooling = pooling  # a pooling request's (pool reads it from the SeqStart)
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + outputs so far
        self.num_prompt_tokens = len(prompt_token_ids)
        # While it runs, its step counters (`num_computed_tokens`, `num_pending`,
        # `num_dropped`, `wants_prompt_logits`) live in its row of the scheduler's running
        # table (flowllm.scheduling.running); these attributes read and write there.
        self.running_in: RunningRows | None = None
        self.running_row = -1
        self._num_computed_tokens = 0
        self.num_cached_tokens = -1  # -1 until the first admission looks up the cache
        self.status = SequenceStatus.WAITING
        self.stop_reason: str | int | None = None
        self.started = False  # has a SeqStart gone downstream?
        # execute returns its prompt logits until its prompt has been computed once
        # (a recompute after preemption does not ask again).
        self._wants_prompt_logits = params.prompt_logprobs is not None
        # Tokens that steps in flight sample for it, not yet appended by `apply`. Ahead of
        # them it may only be scheduled with placeholders (async scheduling), whose input
        # token is read on the device from where its newest in-flight token is sampled
        # (the running table's `sampled_step` and `sampled_row`).
        self._num_pending = 0
        # In-flight tokens that `apply` drops: ones computed from a token that never came.
        self._num_dropped = 0
        # May it take placeholders? Not under a grammar, whose masks need each token before
        # the next step (drafts are another matter: `params.takes_drafts`).
        self.runs_ahead = params.structured_outputs is None
        # Speculative decoding: the drafts proposed for its next step (from `apply`, those
        # the step has room for once scheduled), and how many the step in flight verifies.
        self.draft_token_ids: tuple[int, ...] = ()
        self.num_draft_tokens = 0

    # ------------------------------------------------------------------ step counters
    num_computed_tokens = _StepCounter(int)
    num_pending = _StepCounter(int)
    num_dropped = _StepCounter(int)
    wants_prompt_logits = _StepCounter(bool)

    def enter_rows(self, rows: RunningRows, row: int) -> None:
        """It runs now: `rows` (which copied its counters into `row`) holds them."""
        self.running_in, self.running_row = rows, row

    def leave_rows(self) -> None:
        """It stops running: take its counters back from its row."""
        if self.running_in is None:
            raise RuntimeError(f"sequence {self.seq_id} is not in the running table")
        held = [(name, getattr(self, name)) for name in MOVED]  # read in its row
        self.running_in, self.running_row = None, -1
        for name, value in held:  # now its own
            setattr(self, name, value)

    # ------------------------------------------------------------------ derived
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status > SequenceStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        return FINISH_REASONS.get(self.status)

    def to_start(self) -> SeqStart:
        """What the step loop keeps about this sequence (sent the first step it runs)."""
        return SeqStart(
            seq_id=self.seq_id,
            request_id=self.request_id,
            index=self.index,
            params=self.params,
            prompt_token_ids=self.prompt_token_ids,
            eos_token_ids=self.eos_token_ids,
            pooling=self.pooling,
        )

    def to_choice_start(self, start: SeqStart, scheduled_time: float) -> ChoiceStart:
        """What detokenize keeps about this sequence: `start` (this sequence's `to_start`)
        and its text-only fields; `scheduled_time` is time.monotonic() of its first step."""
        return ChoiceStart(seq=start, prompt_text=self.prompt_text, scheduled_time=scheduled_time)

    def to_finished(self) -> FinishedSeq:
        reason = FINISH_REASONS.get(self.status)
        if reason is None:
            raise ValueError(f"sequence {self.seq_id} is not finished ({self.status.name})")
        return FinishedSeq(
            seq_id=self.seq_id,
            request_id=self.request_id,
            index=self.index,
            finish_reason=reason,
            stop_reason=self.stop_reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            num_cached_tokens=max(self.num_cached_tokens, 0),
        )

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, request_id={self.request_id!r}, "
            f"status={self.status.name}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens})"
        )
