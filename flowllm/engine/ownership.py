"""Which front owns each request and sequence in the core, so that outputs go home.

With `--api-server-count N`, N fronts feed one core: requests arrive from a front, and
the step loop's per-step messages (`StepTokens`, `ChoiceEvents`) carry every running
sequence's share together. `Ownership` learns a request's front as the request arrives,
a sequence's front as it starts (a `ChoiceEvents.started` entry names its request), and
splits each outgoing message into one part per front, forgetting a sequence once its
last token or its end has passed and a request once all its choices have. A step goes
whole to the front that owns every live sequence, if one does (always, with one front). A
pooling graph's core sends the fronts chunks (`TextDeltas`, each naming its request)
instead of tokens: a request is forgotten once its choices' last chunks have passed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import msgspec

from flowllm.messages import (
    Abort,
    ChoiceEvents,
    ChoiceStart,
    Chunk,
    Finish,
    RequestError,
    StepTokens,
    TextDeltas,
    TokenizedRequest,
    TokenLogprobs,
)


class Ownership:
    """Request and sequence ownership by front index, learned from the traffic itself."""

    def __init__(self) -> None:
        self._request_front: dict[str, int] = {}
        self._open_choices: dict[str, int] = {}  # request -> its choices not yet ended
        self._started: dict[str, int] = {}  # request -> its choices started so far
        self._seq: dict[int, tuple[int, str]] = {}  # seq id -> (front, request id)
        self._live: dict[int, int] = {}  # front -> how many of `_seq` it owns (none: absent)

    def __len__(self) -> int:
        return len(self._request_front)

    def requests_of(self, front: int) -> list[str]:
        return [r for r, f in self._request_front.items() if f == front]

    # -- what arrives from a front ----------------------------------------------------------

    def arrived(self, front: int, message: object) -> None:
        if isinstance(message, TokenizedRequest):
            self._request_front[message.request_id] = front
            self._open_choices[message.request_id] = message.params.n
        elif isinstance(message, Abort):
            if message.request_id in self._open_choices and not self._started.get(
                message.request_id
            ):
                self._forget_request(message.request_id)  # aborted before it started
        elif isinstance(message, Finish):
            self._end_seq(message.seq_id)

    # -- what leaves for the fronts ---------------------------------------------------------

    def route(self, _channel: str, message: object) -> Sequence[tuple[int, object]]:
        if isinstance(message, StepTokens):
            return self._split_tokens(message)
        if isinstance(message, ChoiceEvents):
            return self._split_events(message)
        if isinstance(message, TextDeltas):
            return self._split_chunks(message)
        if isinstance(message, RequestError):
            front = self._request_front.get(message.request_id)
            self._forget_request(message.request_id)
            return [] if front is None else [(front, message)]
        raise TypeError(f"no route for {type(message).__name__}")

    def learn(self, message: object) -> None:
        """What `route` learns from a message leaving the core, without splitting it: a
        front's view of its own traffic, which only a step's finishes change."""
        if isinstance(message, StepTokens):
            self._end_finished(message)
        else:
            self.route("", message)

    def front_of_request(self, request_id: str) -> int | None:
        return self._request_front.get(request_id)

    def _split_events(self, events: ChoiceEvents) -> list[tuple[int, object]]:
        started: dict[int, list[ChoiceStart]] = defaultdict(list)
        for choice in events.started:
            front = self._request_front.get(choice.request_id)
            if front is not None:
                if choice.seq_id not in self._seq:
                    self._live[front] = self._live.get(front, 0) + 1
                self._seq[choice.seq_id] = (front, choice.request_id)
                self._started[choice.request_id] = self._started.get(choice.request_id, 0) + 1
                started[front].append(choice)
        ended: dict[int, list[int]] = defaultdict(list)
        for seq_id in events.ended:
            owner = self._seq.get(seq_id)
            if owner is not None:
                ended[owner[0]].append(seq_id)
                self._end_seq(seq_id)
        return [
            (
                front,
                ChoiceEvents(
                    step_id=events.step_id,
                    started=tuple(started.get(front, ())),
                    ended=tuple(ended.get(front, ())),
                ),
            )
            for front in sorted(started.keys() | ended.keys())
        ]

    def _split_chunks(self, deltas: TextDeltas) -> list[tuple[int, object]]:
        chunks: dict[int, list[Chunk]] = defaultdict(list)
        for chunk in deltas.chunks:
            front = self._request_front.get(chunk.request_id)
            if front is None:
                continue
            chunks[front].append(chunk)
            if chunk.finish_reason is not None:
                self._end_choice(chunk.request_id)
        if len(chunks) == 1 and len(next(iter(chunks.values()))) == len(deltas.chunks):
            return [(next(iter(chunks)), deltas)]
        return [
            (front, TextDeltas(step_id=deltas.step_id, chunks=tuple(parts)))
            for front, parts in sorted(chunks.items())
        ]

    def _split_tokens(self, step: StepTokens) -> list[tuple[int, object]]:
        if len(self._live) == 1:  # one front runs every sequence: the step is all its own
            (front,) = self._live
            self._end_finished(step)
            return [(front, step)]
        rows: dict[int, list[int]] = defaultdict(list)  # front -> its rows of the step
        finished: list[int] = []
        seqs = self._seq
        sampled = step.sampled
        for row, seq_id in enumerate(sampled.seq_ids):
            owner = seqs.get(seq_id)
            if owner is not None:
                rows[owner[0]].append(row)
                if row in sampled.finishes:
                    finished.append(seq_id)
        prompt: dict[int, dict[int, tuple[TokenLogprobs | None, ...]]] = defaultdict(dict)
        for seq_id, logprobs in step.prompt_logprobs.items():
            owner = seqs.get(seq_id)
            if owner is not None:
                prompt[owner[0]][seq_id] = logprobs
        for seq_id in finished:
            self._end_seq(seq_id)
        fronts = sorted(rows.keys() | prompt.keys())
        if len(fronts) == 1 and len(rows[fronts[0]]) == len(sampled):
            return [(fronts[0], step)]
        return [
            (
                front,
                msgspec.structs.replace(
                    step,
                    sampled=sampled.take(rows.get(front, ())),
                    prompt_logprobs=prompt.get(front, {}),
                ),
            )
            for front in fronts
        ]

    def _end_finished(self, step: StepTokens) -> None:
        """End the sequences whose tokens in `step` finish them."""
        seq_ids = step.sampled.seq_ids
        for row in step.sampled.finishes:
            self._end_seq(seq_ids[row])

    def _end_seq(self, seq_id: int) -> None:
        owner = self._seq.pop(seq_id, None)
        if owner is not None:
            front = owner[0]
            if self._live[front] == 1:
                del self._live[front]
            else:
                self._live[front] -= 1
            self._end_choice(owner[1])

    def _end_choice(self, request_id: str) -> None:
        left = self._open_choices.get(request_id, 0) - 1
        if left <= 0:
            self._forget_request(request_id)
        else:
            self._open_choices[request_id] = left

    def _forget_request(self, request_id: str) -> None:
        self._request_front.pop(request_id, None)
        self._open_choices.pop(request_id, None)
        self._started.pop(request_id, None)

    def live_seqs_of(self, front: int) -> list[int]:
        return [seq for seq, (f, _) in self._seq.items() if f == front]
