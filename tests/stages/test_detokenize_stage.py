"""detokenize keeps a choice from schedule's ChoiceEvents to its last chunk, and no longer."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import anyio

from flowllm.graph.stage import NoParams
from flowllm.messages import (
    ChoiceEvents,
    ChoiceStart,
    Finish,
    SampledToken,
    SampledTokens,
    SamplingParams,
    SeqStart,
    StepTokens,
    TextDeltas,
)
from flowllm.stages.detokenize import Detokenize
from flowllm.text.detokenizer import ByteVocab


class Outbox:
    """Stands in for a stage context: keeps what the stage emits, by port."""

    def __init__(self) -> None:
        self.sent: dict[str, list[Any]] = {}

    async def emit(self, port: str, message: Any) -> None:
        self.sent.setdefault(port, []).append(message)


def choice(seq_id: int, request_id: str, prompt: tuple[int, ...], **params: Any) -> ChoiceStart:
    seq = SeqStart(
        seq_id=seq_id,
        request_id=request_id,
        index=0,
        params=SamplingParams(**params),
        prompt_token_ids=prompt,
        eos_token_ids=(50256,),
    )
    return ChoiceStart(seq=seq, prompt_text="echo", scheduled_time=5.0)


def test_choices_live_from_their_start_to_their_last_chunk(gpt2_tokenizer: Any) -> None:
    tok = gpt2_tokenizer
    services = SimpleNamespace(tokenizer=tok, byte_vocab=lambda: ByteVocab.of(tok))
    stage = Detokenize(NoParams(), services)  # type: ignore[arg-type]
    prompt = tuple(tok.encode("The weather"))
    hello, world, dot = (tuple(tok.encode(t)) for t in (" is", " fine", "."))
    out = Outbox()

    async def scenario() -> None:
        starts = (choice(0, "a", prompt), choice(1, "b", prompt, stop=(" fine",)))
        await stage.handle(ChoiceEvents(step_id=0, started=(*starts, choice(2, "c", prompt))), out)  # type: ignore[arg-type]
        assert stage.live_sequences() == 3
        assert stage.request_ids(ChoiceEvents(step_id=0, started=starts)) == ("a", "b")
        tokens = (
            SampledToken(seq_id=0, token_id=hello[0]),
            SampledToken(seq_id=1, token_id=hello[0]),
            SampledToken(seq_id=2, token_id=hello[0]),
        )
        await stage.handle(StepTokens(step_id=0, sampled=SampledTokens.of(tokens)), out)  # type: ignore[arg-type]
        # c is aborted: schedule says so; its tokens still in flight are skipped
        await stage.handle(ChoiceEvents(step_id=1, ended=(2,)), out)  # type: ignore[arg-type]
        assert stage.live_sequences() == 2
        tokens = (
            SampledToken(seq_id=0, token_id=world[0]),
            SampledToken(seq_id=1, token_id=world[0]),  # completes b's stop string
            SampledToken(seq_id=2, token_id=world[0]),
        )
        await stage.handle(StepTokens(step_id=1, sampled=SampledTokens.of(tokens)), out)  # type: ignore[arg-type]
        assert stage.live_sequences() == 1  # b's last chunk is out
        tokens = (
            SampledToken(seq_id=0, token_id=dot[0], finish_reason="length"),
            SampledToken(seq_id=1, token_id=dot[0]),  # sampled past its stop string
        )
        await stage.handle(StepTokens(step_id=2, sampled=SampledTokens.of(tokens)), out)  # type: ignore[arg-type]
        assert stage.live_sequences() == 0  # a's last chunk is out

    anyio.run(scenario)
    chunks = [
        c for deltas in out.sent["out"] for c in deltas.chunks if isinstance(deltas, TextDeltas)
    ]
    texts: dict[str, str] = {}
    token_ids: dict[str, tuple[int, ...]] = {}
    for c in chunks:
        texts[c.request_id] = texts.get(c.request_id, "") + c.text
        token_ids[c.request_id] = token_ids.get(c.request_id, ()) + c.token_ids
    # every chunk carries its own token, whether it goes through the fast path or not
    assert token_ids == {
        "a": (hello[0], world[0], dot[0]),
        "b": (hello[0], world[0]),
        "c": hello[:1],
    }
    assert texts == {
        "a": tok.decode([*hello, *world, *dot]),
        "b": tok.decode(hello),
        "c": tok.decode(hello),
    }
    first = {c.request_id: c for c in reversed(chunks)}
    assert first["a"].prompt_text == "echo" and first["a"].scheduled_time == 5.0
    assert first["a"].prompt_token_ids == prompt
    last = {c.request_id: c for c in chunks}
    assert (last["a"].finish_reason, last["b"].finish_reason, last["c"].finish_reason) == (
        "length",
        "stop",
        None,
    )
    assert last["b"].stop_reason == " fine"
    assert out.sent["finishes"] == [Finish(1, " fine")]
