"""Chat completion responses (`chat.completion`, `chat.completion.chunk`) from chunks.

Streaming opens every choice with a chunk carrying `delta.role`, then content deltas; the
last delta of a choice carries its finish_reason.
"""

from __future__ import annotations

import msgspec
from anyio.abc import TaskGroup

from flowllm.api.completions import DONE, error_event, sse
from flowllm.api.convert import PreparedChat
from flowllm.api.logprobs import chat_logprobs
from flowllm.api.protocol import (
    ChatChoice,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogProbs,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
)
from flowllm.api.serving import Emit, EventSource, Generation, ResponseFormat
from flowllm.messages import Chunk, RequestError

ROLE = "assistant"


class ChatFormat(ResponseFormat[PreparedChat]):
    """How one chat request's chunks become OpenAI chat choices."""

    def logprobs(self, chunk: Chunk) -> ChatLogProbs | None:
        if self.prepared.logprobs is None:
            return None
        return ChatLogProbs(
            content=chat_logprobs(self.texts, chunk.logprobs, self.prepared.logprobs)
        )

    def response(self, merged: dict[int, Chunk]) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=chunk.index,
                message=ChatResponseMessage(role=ROLE, content=chunk.text),
                logprobs=self.logprobs(chunk),
                finish_reason=chunk.finish_reason,
                stop_reason=chunk.stop_reason,
            )
            for chunk in sorted(merged.values(), key=lambda c: c.index)
        ]
        prompt_tokens = max((c.num_prompt_tokens for c in merged.values()), default=0)
        completion_tokens = sum(c.num_output_tokens for c in merged.values())
        return ChatCompletionResponse(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=UsageInfo.of(prompt_tokens, completion_tokens),
        )


class ChatStream(EventSource):
    """The SSE body of a streamed chat completion."""

    def __init__(self, generation: Generation, fmt: ChatFormat, encoder: msgspec.json.Encoder):
        self.generation = generation
        self.fmt = fmt
        self.encoder = encoder

    def _event(self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> bytes:
        include_usage = self.fmt.prepared.include_usage
        event = ChatCompletionStreamResponse(
            id=self.fmt.response_id,
            created=self.fmt.created,
            model=self.fmt.model,
            choices=choices,
            usage=usage if include_usage else msgspec.UNSET,
        )
        return sse(self.encoder, event)

    async def run(self, emit: Emit, task_group: TaskGroup) -> None:
        fmt = self.fmt
        for index in range(fmt.prepared.n):
            opening = ChatStreamChoice(index=index, delta=DeltaMessage(role=ROLE, content=""))
            await emit(self._event([opening]))
        prompt_tokens = 0
        output_tokens: dict[int, int] = {}
        async for _, item in self.generation.start_pumps(task_group):
            if isinstance(item, RequestError):
                await emit(error_event(self.encoder, item))
                break
            prompt_tokens = max(prompt_tokens, item.num_prompt_tokens)
            output_tokens[item.index] = item.num_output_tokens
            if not (item.text or item.finish_reason or item.logprobs):
                continue
            choice = ChatStreamChoice(
                index=item.index,
                delta=DeltaMessage(content=item.text) if item.text else DeltaMessage(),
                logprobs=fmt.logprobs(item),
                finish_reason=item.finish_reason,
                stop_reason=item.stop_reason,
            )
            await emit(self._event([choice]))
        else:
            if fmt.prepared.include_usage:
                usage = UsageInfo.of(prompt_tokens, sum(output_tokens.values()))
                await emit(self._event([], usage))
        await emit(DONE)

    def close(self) -> None:
        self.generation.close()
