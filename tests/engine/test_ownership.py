"""Ownership: the core sends each front the outputs of its own requests, and forgets a
sequence once its end has passed and a request once all its choices have."""

from __future__ import annotations

from flowllm.engine.ownership import Ownership
from flowllm.messages import (
    Abort,
    ChoiceEvents,
    ChoiceStart,
    Finish,
    RequestError,
    SampledToken,
    SampledTokens,
    SamplingParams,
    SeqStart,
    StepTokens,
    TokenizedRequest,
)


def request(request_id: str, n: int = 1) -> TokenizedRequest:
    return TokenizedRequest(
        request_id=request_id,
        prompt_token_ids=(1, 2),
        params=SamplingParams(n=n, max_tokens=4),
        eos_token_ids=(0,),
        arrival_time=0.0,
    )


def started(seq_id: int, request_id: str, index: int = 0) -> ChoiceStart:
    seq = SeqStart(
        seq_id=seq_id,
        request_id=request_id,
        index=index,
        params=SamplingParams(),
        prompt_token_ids=(1, 2),
        eos_token_ids=(0,),
    )
    return ChoiceStart(seq=seq)


def token(seq_id: int, finish: str | None = None) -> SampledToken:
    return SampledToken(seq_id=seq_id, token_id=7, finish_reason=finish)  # type: ignore[arg-type]


def test_each_front_gets_only_its_own_sequences() -> None:
    owners = Ownership()
    owners.arrived(0, request("a"))
    owners.arrived(1, request("b", n=2))
    events = owners.route(
        "detokenize.choices",
        ChoiceEvents(step_id=1, started=(started(10, "a"), started(11, "b"), started(12, "b", 1))),
    )
    by_front = {front: part for front, part in events}
    assert [c.seq_id for c in by_front[0].started] == [10]  # type: ignore[attr-defined]
    assert [c.seq_id for c in by_front[1].started] == [11, 12]  # type: ignore[attr-defined]
    step = StepTokens(step_id=1, sampled=SampledTokens.of((token(10), token(11), token(12))))
    parts = dict(owners.route("detokenize.in", step))
    assert [t.seq_id for t in parts[0].sampled] == [10]  # type: ignore[attr-defined]
    assert [t.seq_id for t in parts[1].sampled] == [11, 12]  # type: ignore[attr-defined]
    alone = StepTokens(step_id=2, sampled=SampledTokens.of((token(11),)))
    assert owners.route("detokenize.in", alone) == [(1, alone)]  # one front: sent as it is


def test_a_step_whose_sequences_are_one_fronts_goes_to_it_whole() -> None:
    """Once every live sequence is one front's, a step is not split: it goes as it is, a
    late token of another front's ended sequence with it (the front ignores unknown
    sequences), and its finishes still end the sequences."""
    owners = Ownership()
    owners.arrived(0, request("a"))
    owners.arrived(1, request("b"))
    owners.route("c", ChoiceEvents(step_id=1, started=(started(10, "a"), started(11, "b"))))
    first = StepTokens(step_id=1, sampled=SampledTokens.of((token(10), token(11, "length"))))
    assert [front for front, _ in owners.route("t", first)] == [0, 1]
    late = StepTokens(step_id=2, sampled=SampledTokens.of((token(10), token(11))))
    assert owners.route("t", late) == [(0, late)]
    last = StepTokens(step_id=3, sampled=SampledTokens.of((token(10, "stop"),)))
    assert owners.route("t", last) == [(0, last)]
    assert owners.live_seqs_of(0) == [] and len(owners) == 0


def test_sequences_and_requests_are_forgotten_as_they_end() -> None:
    owners = Ownership()
    owners.arrived(0, request("a", n=2))
    owners.route("c", ChoiceEvents(step_id=1, started=(started(1, "a"), started(2, "a", 1))))
    owners.route("t", StepTokens(step_id=1, sampled=SampledTokens.of((token(1, "length"),))))
    assert owners.requests_of(0) == ["a"] and owners.live_seqs_of(0) == [2]
    owners.arrived(0, Finish(seq_id=2))  # a stop string ended the other choice
    assert owners.requests_of(0) == [] and owners.live_seqs_of(0) == []
    assert (
        owners.route("t", StepTokens(step_id=2, sampled=SampledTokens.of((token(2),)))) == []
    )  # late: dropped


def test_errors_go_home_and_aborted_requests_are_forgotten() -> None:
    owners = Ownership()
    owners.arrived(1, request("x"))
    owners.arrived(1, request("y"))
    error = RequestError(request_id="x", message="no")
    assert owners.route("deliver.errors", error) == [(1, error)]
    owners.arrived(1, Abort("y"))  # before it started
    assert len(owners) == 0
    assert owners.route("deliver.errors", RequestError(request_id="z", message="?")) == []


def test_learning_without_routing_keeps_the_same_books() -> None:
    """A front watching what its core sends it learns what routing would have."""
    routed, learned = Ownership(), Ownership()
    events = ChoiceEvents(step_id=1, started=(started(1, "a"), started(2, "a", 1)))
    steps = [
        StepTokens(step_id=1, sampled=SampledTokens.of((token(1), token(2)))),
        StepTokens(step_id=2, sampled=SampledTokens.of((token(1, "length"), token(2)))),
    ]
    for owners in (routed, learned):
        owners.arrived(0, request("a", n=2))
    routed.route("c", events)
    learned.learn(events)
    for step in steps:
        routed.route("t", step)
        learned.learn(step)
    assert learned.live_seqs_of(0) == routed.live_seqs_of(0) == [2]
    assert learned.requests_of(0) == routed.requests_of(0) == ["a"]
    ended = StepTokens(step_id=3, sampled=SampledTokens.of((token(2, "stop"),)))
    routed.route("t", ended)
    learned.learn(ended)
    assert learned.live_seqs_of(0) == routed.live_seqs_of(0) == []
    assert learned.requests_of(0) == routed.requests_of(0) == []
