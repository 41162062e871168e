"""detokenize: sampled tokens to text, per choice, incrementally and UTF-8 safe.

A stop string found in the text ends its sequence here: the choice's last chunk says
`finish_reason="stop"` with the string as `stop_reason`, and a `Finish` tells schedule to
free the sequence at once (tokens it already sampled beyond are dropped here).
The first chunk of each choice carries the prompt (for echo and prompt logprobs).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from flowllm.graph.stage import PerMessageStage, StageContext
from flowllm.messages import (
    Chunk,
    Finish,
    FinishReason,
    RequestError,
    SampledToken,
    SamplingParams,
    SeqStart,
    StepTokens,
    TextDeltas,
    TokenLogprobs,
)
from flowllm.stages.services import EngineServices
from flowllm.text.detokenizer import Decode, IncrementalDetokenizer, make_decode


@dataclass
class _Choice:
    """One sequence's text state (this stage's own; schedule owns the sequence)."""

    start: SeqStart
    detokenizer: IncrementalDetokenizer
    num_prompt_tokens: int
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    num_output_tokens: int = 0
    sent_first: bool = False
    done: bool = False


class Detokenize(PerMessageStage):
    inputs = {"in": StepTokens}
    outputs = {"out": TextDeltas, "finishes": Finish}

    def __init__(self, params: Any, services: EngineServices) -> None:
        super().__init__(params, services)
        self._tokenizer = services.tokenizer
        self._byte_vocab = services.byte_vocab()
        self._decoders: dict[tuple[bool, bool], Decode] = {}  # by the two decode flags
        self._choices: dict[int, _Choice] = {}

    def live_sequences(self) -> int:
        return len(self._choices)

    def request_ids(self, message: Any) -> tuple[str, ...]:
        """A step's requests: those of its new sequences and of its tokens' sequences."""
        if not isinstance(message, StepTokens):
            return super().request_ids(message)
        choices = self._choices
        ids = [start.request_id for start in message.started]
        ids += [choices[t.seq_id].start.request_id for t in message.tokens if t.seq_id in choices]
        return tuple(dict.fromkeys(ids))

    async def fail_requests(self, errors: Iterable[RequestError], message: Any = None) -> None:
        """A request whose text failed: its sequences end here and in schedule (which frees
        their blocks), and the error goes to its mailbox."""
        errors = list(errors)
        failed = {error.request_id for error in errors}
        ended: list[int] = []
        for seq_id, choice in self._choices.items():
            if choice.start.request_id in failed and not choice.done:
                choice.done = True
                ended.append(seq_id)
        if isinstance(message, StepTokens):  # sequences it failed before learning of them
            ended += [s.seq_id for s in message.started if s.request_id in failed]
        for seq_id in dict.fromkeys(ended):
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

    async def handle(self, step: StepTokens, ctx: StageContext) -> None:
        choices = self._choices
        for seq_id in step.released:
            choices.pop(seq_id, None)
        for start in step.started:
            choices[start.seq_id] = _Choice(
                start,
                IncrementalDetokenizer(
                    self._tokenizer,
                    start.prompt_token_ids,
                    start.params,
                    decode=self._decode_for(start.params),
                ),
                len(start.prompt_token_ids),
            )
        for seq_id, logprobs in step.prompt_logprobs.items():
            choice = choices.get(seq_id)
            if choice is not None:
                choice.prompt_logprobs.extend(logprobs)
        chunks: list[Chunk] = []
        for token in step.tokens:
            choice = choices.get(token.seq_id)
            if choice is None or choice.done:
                continue
            choice.num_output_tokens += 1
            finish, stop_reason = token.finish_reason, token.stop_reason
            detokenizer = choice.detokenizer
            middle = finish is None and choice.sent_first and token.logprobs is None
            text = detokenizer.append(token.token_id) if middle else None
            if text is None:
                # EOS / a stop token id: its text is left out (as vLLM, unless asked to keep it)
                out = detokenizer.step_token(token.token_id, stop_terminated=finish == "stop")
                text = out.text_delta
                if out.stop_string is not None:
                    finish, stop_reason, middle = "stop", out.stop_string, False
                    await ctx.emit("finishes", Finish(token.seq_id, out.stop_string))
                elif finish is not None:
                    text += detokenizer.finish().text_delta
                if finish is not None:
                    choice.done = True
            if middle:  # the common case: only the fields without defaults
                start = choice.start
                chunks.append(
                    Chunk(
                        request_id=start.request_id,
                        index=start.index,
                        text=text,
                        token_ids=(token.token_id,),
                        num_prompt_tokens=choice.num_prompt_tokens,
                        num_output_tokens=choice.num_output_tokens,
                    )
                )
                continue
            chunks.append(self._chunk(choice, text, token, finish, stop_reason))
        if chunks:
            await ctx.emit("out", TextDeltas(step_id=step.step_id, chunks=tuple(chunks)))

    @staticmethod
    def _chunk(
        choice: _Choice,
        text: str,
        token: SampledToken,
        finish: FinishReason | None,
        stop_reason: str | int | None,
    ) -> Chunk:
        start = choice.start
        chunk = Chunk(
            request_id=start.request_id,
            index=start.index,
            text=text,
            token_ids=(token.token_id,),
            logprobs=(token.logprobs,) if token.logprobs is not None else (),
            finish_reason=finish,
            stop_reason=stop_reason,
            num_prompt_tokens=choice.num_prompt_tokens,
            num_output_tokens=choice.num_output_tokens,
        )
        if choice.sent_first:
            return chunk
        choice.sent_first = True
        return msgspec.structs.replace(
            chunk,
            prompt_text=start.prompt_text,
            prompt_token_ids=start.prompt_token_ids,
            prompt_logprobs=tuple(choice.prompt_logprobs),
            scheduled_time=start.scheduled_time,
        )
