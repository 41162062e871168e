"""detokenize: sampled tokens to text, per choice, incrementally and UTF-8 safe.

A stop string found in the text ends its sequence here: the choice's last chunk says
`finish_reason="stop"` with the string as `stop_reason`, and a `Finish` tells schedule to
free the sequence at once (tokens it already sampled beyond are dropped here).
The first chunk of each choice carries the prompt (for echo and prompt logprobs).

It learns each choice from schedule's `ChoiceEvents` (input `choices`, declared first so it
is read first: schedule sends a choice's start before the batch that runs it, so the start
is always waiting when the choice's first tokens arrive). It drops a choice once its last
chunk is out, or when `ChoiceEvents.ended` says it ended unseen (aborted, lost).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import repeat

import msgspec

from flowllm.graph.stage import NoParams, PerMessageStage, StageContext
from flowllm.messages import (
    NO_FINISH,
    ChoiceEvents,
    ChoiceStart,
    Chunk,
    Finish,
    FinishReason,
    RequestError,
    SamplingParams,
    StepTokens,
    TextDeltas,
    TokenLogprobs,
)
from flowllm.stages.services import EngineServices
from flowllm.text.detokenizer import Decode, IncrementalDetokenizer, make_decode


@dataclass(slots=True)
class _Choice:
    """One sequence's text state (this stage's own; `start` is schedule's, read only)."""

    start: ChoiceStart
    detokenizer: IncrementalDetokenizer
    num_prompt_tokens: int
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    sent_first: bool = False


class Detokenize(PerMessageStage):
    inputs = {"choices": ChoiceEvents, "in": StepTokens}
    outputs = {"out": TextDeltas, "finishes": Finish}

    def __init__(self, params: NoParams, services: EngineServices) -> None:
        super().__init__(params, services)
        self._tokenizer = services.tokenizer
        self._byte_vocab = services.byte_vocab()
        self._decoders: dict[tuple[bool, bool], Decode] = {}  # by the two decode flags
        self._choices: dict[int, _Choice] = {}  # the choices whose last chunk is not out
        # token id -> the one-token tuple that chunks carry, made once: a new tuple per
        # chunk is what sets off most of the front process's young-object collections
        self._one_token: dict[int, tuple[int]] = {}

    def live_sequences(self) -> int:
        return len(self._choices)

    def request_ids(self, message: object) -> tuple[str, ...]:
        """The requests of a message's choices: starting ones, or its tokens' ones."""
        if isinstance(message, ChoiceEvents):
            return tuple(dict.fromkeys(c.seq.request_id for c in message.started))
        if not isinstance(message, StepTokens):
            return super().request_ids(message)
        choices = self._choices
        ids = [
            choices[seq_id].start.seq.request_id
            for seq_id in message.sampled.seq_ids
            if seq_id in choices
        ]
        return tuple(dict.fromkeys(ids))

    async def fail_requests(self, errors: Iterable[RequestError], message: object = None) -> None:
        """A request whose text failed: its sequences end here and in schedule (which frees
        their blocks), and the error goes to its mailbox."""
        errors = list(errors)
        failed = {error.request_id for error in errors}
        ended = [
            seq_id
            for seq_id, choice in self._choices.items()
            if choice.start.seq.request_id in failed
        ]
        if isinstance(message, ChoiceEvents):  # sequences it failed before learning of them
            ended += [c.seq.seq_id for c in message.started if c.seq.request_id in failed]
        for seq_id in dict.fromkeys(ended):
            self._choices.pop(seq_id, None)
            await self.context.emit("finishes", Finish(seq_id, None))
        await super().fail_requests(errors, message)

    def _decode_for(self, params: SamplingParams) -> Decode:
        """One decode function per flag pair, shared by every sequence using it."""
        key = (params.skip_special_tokens, params.spaces_between_special_tokens)
        decode = self._decoders.get(key)
        if decode is None:
            decode = make_decode(self._tokenizer, *key, self._byte_vocab)
            self._decoders[key] = decode
        return decode

    async def handle(self, message: StepTokens | ChoiceEvents, ctx: StageContext) -> None:
        if isinstance(message, ChoiceEvents):
            self._learn(message)
        else:
            await self._detokenize(message, ctx)

    def _learn(self, events: ChoiceEvents) -> None:
        choices = self._choices
        for seq_id in events.ended:
            choices.pop(seq_id, None)
        for choice in events.started:
            seq = choice.seq
            choices[seq.seq_id] = _Choice(
                choice,
                IncrementalDetokenizer(
                    self._tokenizer,
                    seq.prompt_token_ids,
                    seq.params,
                    decode=self._decode_for(seq.params),
                ),
                len(seq.prompt_token_ids),
            )

    async def _detokenize(self, step: StepTokens, ctx: StageContext) -> None:
        choices = self._choices
        for seq_id, logprobs in step.prompt_logprobs.items():
            choice = choices.get(seq_id)
            if choice is not None:
                choice.prompt_logprobs.extend(logprobs)
        chunks: list[Chunk] = []
        one_token = self._one_token
        rows = step.sampled
        finishes = rows.finishes
        # each row's (finish reason, stop token id), or None while it goes on
        ends = [finishes.get(row) for row in range(len(rows))] if finishes else repeat(None)
        for seq_id, token_id, ended, lp in zip(  # the repeats run on: not strict
            rows.seq_ids, rows.token_ids, ends, rows.logprobs or repeat(None), strict=False
        ):
            choice = choices.get(seq_id)
            if choice is None:  # not started here, ended, or tokens sampled past its end
                continue
            token_ids = one_token.get(token_id)
            if token_ids is None:
                token_ids = one_token[token_id] = (token_id,)
            detokenizer = choice.detokenizer
            middle = ended is None and choice.sent_first and lp is None
            text = detokenizer.append(token_id) if middle else None
            if text is None:
                finish: FinishReason | None
                stop_reason: str | int | None
                finish, stop_reason = ended or NO_FINISH
                # EOS / a stop token id: its text is left out (as vLLM, unless asked to keep it)
                out = detokenizer.step_token(token_id, stop_terminated=finish == "stop")
                text = out.text_delta
                if out.stop_string is not None:
                    finish, stop_reason, middle = "stop", out.stop_string, False
                    await ctx.emit("finishes", Finish(seq_id, out.stop_string))
                elif finish is not None:
                    text += detokenizer.finish().text_delta
                if finish is not None:
                    del choices[seq_id]  # its last chunk follows
            if middle:  # the common case: only the fields without defaults
                seq = choice.start.seq
                chunks.append(
                    Chunk(
                        request_id=seq.request_id,
                        index=seq.index,
                        text=text,
                        token_ids=token_ids,
                        num_prompt_tokens=choice.num_prompt_tokens,
                        num_output_tokens=detokenizer.num_output_tokens,
                    )
                )
                continue
            chunks.append(self._chunk(choice, text, token_ids, lp, finish, stop_reason))
        if chunks:
            await ctx.emit("out", TextDeltas(step_id=step.step_id, chunks=tuple(chunks)))

    @staticmethod
    def _chunk(
        choice: _Choice,
        text: str,
        token_ids: tuple[int],
        logprobs: TokenLogprobs | None,
        finish: FinishReason | None,
        stop_reason: str | int | None,
    ) -> Chunk:
        start = choice.start
        seq = start.seq
        chunk = Chunk(
            request_id=seq.request_id,
            index=seq.index,
            text=text,
            token_ids=token_ids,
            logprobs=(logprobs,) if logprobs is not None else (),
            finish_reason=finish,
            stop_reason=stop_reason,
            num_prompt_tokens=choice.num_prompt_tokens,
            num_output_tokens=choice.detokenizer.num_output_tokens,
        )
        if choice.sent_first:
            return chunk
        choice.sent_first = True
        return msgspec.structs.replace(
            chunk,
            prompt_text=start.prompt_text,
            prompt_token_ids=seq.prompt_token_ids,
            prompt_logprobs=tuple(choice.prompt_logprobs),
            scheduled_time=start.scheduled_time,
        )
