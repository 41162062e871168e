"""Completion responses (`text_completion`) from the graph's chunks, whole or streamed.

Choice index = prompt index * n + choice. With `echo` the returned text starts with the
prompt and, with `logprobs`, every prompt token has its logprob (the first one null)
followed by the generated tokens' — one aligned list, as lm-evaluation-harness expects.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
from anyio.abc import TaskGroup

from flowllm.api.convert import PreparedCompletion
from flowllm.api.errors import ApiError
from flowllm.api.logprobs import completion_logprobs, prompt_logprobs_entries
from flowllm.api.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionResponse,
    CompletionStreamResponse,
    ErrorResponse,
    UsageInfo,
)
from flowllm.api.serving import Emit, EventSource, Generation, ResponseFormat
from flowllm.messages import Chunk, FinishReason, RequestError, TokenLogprobs


class CompletionFormat(ResponseFormat[PreparedCompletion]):
    """How one completion request's chunks become OpenAI choices."""

    def choice_index(self, prompt_index: int, chunk: Chunk) -> int:
        return prompt_index * self.prepared.n + chunk.index

    def prompt_text(self, chunk: Chunk) -> str:
        if chunk.prompt_text is not None:
            return chunk.prompt_text
        return self.texts.decode(chunk.prompt_token_ids)

    def choice(
        self, index: int, chunk: Chunk, *, first: bool, text_offset: int
    ) -> CompletionChoice:
        """The choice for `chunk` (a whole choice, or the next delta when streaming).

        `first`: this chunk opens the choice, so it carries the echoed prompt.
        """
        echo = self.prepared.echo and first
        finish: FinishReason | None
        stop_reason: str | int | None
        if self.prepared.echo_only:
            token_ids: Sequence[int] = ()
            entries: Sequence[TokenLogprobs | None] = ()
            text = ""
            finish, stop_reason = ("length", None) if chunk.finish_reason else (None, None)
        else:
            token_ids, entries, text = chunk.token_ids, chunk.logprobs, chunk.text
            finish, stop_reason = chunk.finish_reason, chunk.stop_reason
        entries = _aligned(entries, len(token_ids))
        prefix = ""
        if echo:
            prefix = self.prompt_text(chunk)
            prompt_ids = chunk.prompt_token_ids
            prompt_entries: Sequence[TokenLogprobs | None] = chunk.prompt_logprobs
            if len(prompt_entries) == len(prompt_ids) - 1:  # the first token's null left out
                prompt_entries = (None, *prompt_entries)
            token_ids = (*prompt_ids, *token_ids)
            entries = (*_aligned(prompt_entries, len(prompt_ids)), *entries)
        logprobs: CompletionLogProbs | None = None
        if self.prepared.logprobs is not None:
            logprobs = completion_logprobs(
                self.texts, token_ids, entries, self.prepared.logprobs, text_offset
            )
        choice = CompletionChoice(
            index=index,
            text=prefix + text,
            logprobs=logprobs,
            finish_reason=finish,
            stop_reason=stop_reason,
        )
        if self.prepared.prompt_logprobs is not None and first:
            choice.prompt_logprobs = prompt_logprobs_entries(
                self.texts, chunk.prompt_logprobs, self.prepared.prompt_logprobs
            )
        return choice

    def output_tokens(self, chunk: Chunk) -> int:
        return 0 if self.prepared.echo_only else chunk.num_output_tokens

    def response(self, results: list[dict[int, Chunk]]) -> CompletionResponse:
        """The whole response from every sub-request's merged chunks."""
        choices = []
        prompt_tokens = completion_tokens = 0
        for prompt_index, merged in enumerate(results):
            if merged:
                prompt_tokens += max(c.num_prompt_tokens for c in merged.values())
            for chunk in merged.values():
                completion_tokens += self.output_tokens(chunk)
                index = self.choice_index(prompt_index, chunk)
                choices.append(self.choice(index, chunk, first=True, text_offset=0))
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=UsageInfo.of(prompt_tokens, completion_tokens),
        )


def _aligned(
    entries: Sequence[TokenLogprobs | None], length: int
) -> Sequence[TokenLogprobs | None]:
    """One logprobs entry per token: nulls where the engine sent none."""
    if len(entries) == length:
        return entries
    return (*entries[:length], *([None] * (length - len(entries))))


# Characters JSON may carry raw but that common line splitters (str.splitlines, httpx's
# aiter_lines) treat as line ends: escaped, so an event never breaks mid-line in a client.
_LINE_BREAKS_IN_JSON = (
    (b"\xc2\x85", b"\\u0085"),
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
)


def sse(encoder: msgspec.json.Encoder, payload: object) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    data = encoder.encode(payload)
    for raw, escaped in _LINE_BREAKS_IN_JSON:
        data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


DONE = b"data: [DONE]\n\n"


def error_event(encoder: msgspec.json.Encoder, error: RequestError) -> bytes:
    return sse(encoder, ErrorResponse(error=ApiError.from_request_error(error).info()))


class CompletionStream(EventSource):
    """The SSE body of a streamed completion: one event per chunk (with its choice's usage
    so far under `continuous_usage_stats`), then usage and [DONE]."""

    def __init__(
        self,
        generation: Generation,
        fmt: CompletionFormat,
        encoder: msgspec.json.Encoder,
    ) -> None:
        self.generation = generation
        self.fmt = fmt
        self.encoder = encoder

    async def run(self, emit: Emit, task_group: TaskGroup) -> None:
        fmt, include_usage = self.fmt, self.fmt.prepared.include_usage
        continuous_usage = fmt.prepared.continuous_usage
        text_lengths: dict[int, int] = {}  # choice index -> returned text so far
        prompt_tokens: dict[int, int] = {}  # prompt index -> its token count
        output_tokens: dict[int, int] = {}  # choice index -> generated tokens so far
        async for prompt_index, item in self.generation.start_pumps(task_group):
            if isinstance(item, RequestError):
                await emit(error_event(self.encoder, item))
                break
            index = fmt.choice_index(prompt_index, item)
            first = index not in text_lengths
            offset = text_lengths.get(index, 0)
            choice = fmt.choice(index, item, first=first, text_offset=offset)
            text_lengths[index] = offset + len(choice.text)
            if item.num_prompt_tokens:
                prompt_tokens[prompt_index] = item.num_prompt_tokens
            output_tokens[index] = fmt.output_tokens(item)
            has_tokens = choice.logprobs is not None and choice.logprobs.tokens
            if not (choice.text or choice.finish_reason or has_tokens):
                continue
            usage: UsageInfo | msgspec.UnsetType | None = msgspec.UNSET
            if continuous_usage:  # this choice's so far, with its prompt's, as vLLM's
                usage = UsageInfo.of(prompt_tokens.get(prompt_index, 0), output_tokens[index])
            elif include_usage:
                usage = None
            event = CompletionStreamResponse(
                id=fmt.response_id,
                created=fmt.created,
                model=fmt.model,
                choices=[choice],
                usage=usage,
            )
            await emit(sse(self.encoder, event))
        else:
            if include_usage:
                usage = UsageInfo.of(sum(prompt_tokens.values()), sum(output_tokens.values()))
                final = CompletionStreamResponse(
                    id=fmt.response_id,
                    created=fmt.created,
                    model=fmt.model,
                    choices=[],
                    usage=usage,
                )
                await emit(sse(self.encoder, final))
        await emit(DONE)

    def close(self) -> None:
        self.generation.close()
