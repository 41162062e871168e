"""Chat completion responses (`chat.completion`, `chat.completion.chunk`) from chunks.

Streaming opens every choice with a chunk carrying `delta.role`, then content deltas; the
last delta of a choice carries its finish_reason. With tool calls (flowllm.api.tool_calls)
the output is parsed as it streams: deltas carry content and `tool_calls` pieces, and a
choice that called tools and stopped finishes with "tool_calls".
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
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    UsageInfo,
)
from flowllm.api.serving import Emit, EventSource, Generation, ResponseFormat
from flowllm.api.tool_calls import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    Event,
    ParsedOutput,
    call_id,
)
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

    def message(self, chunk: Chunk) -> tuple[ChatResponseMessage, str | None]:
        """A whole choice's message and finish_reason (tool calls parsed, if any)."""
        parser = self.prepared.tool_use.parser_for()
        if parser is None:
            return ChatResponseMessage(role=ROLE, content=chunk.text), chunk.finish_reason
        parsed = ParsedOutput()
        parsed.add(parser.feed(chunk.text))
        parsed.add(parser.finish())
        if not parsed.calls:  # what a stream of this output would have sent as content
            return ChatResponseMessage(role=ROLE, content=parsed.content), chunk.finish_reason
        calls = [
            ToolCall(id=call_id(), function=FunctionCall(name=name, arguments=arguments))
            for name, arguments in parsed.calls
        ]
        message = ChatResponseMessage(role=ROLE, content=parsed.content or None, tool_calls=calls)
        return message, tool_calls_finish(chunk.finish_reason)

    def response(self, merged: dict[int, Chunk]) -> ChatCompletionResponse:
        choices = []
        for chunk in sorted(merged.values(), key=lambda c: c.index):
            message, finish_reason = self.message(chunk)
            choices.append(
                ChatChoice(
                    index=chunk.index,
                    message=message,
                    logprobs=self.logprobs(chunk),
                    finish_reason=finish_reason,
                    stop_reason=chunk.stop_reason,
                )
            )
        prompt_tokens = max((c.num_prompt_tokens for c in merged.values()), default=0)
        completion_tokens = sum(c.num_output_tokens for c in merged.values())
        return ChatCompletionResponse(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=UsageInfo.of(prompt_tokens, completion_tokens),
        )


def tool_calls_finish(finish_reason: str | None) -> str | None:
    """A choice that called tools and stopped by itself finishes with "tool_calls"."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def tool_delta(events: list[Event]) -> DeltaMessage:
    """One stream delta from a parser's events: content, and OpenAI's tool-call pieces
    (a call's first piece carries its id, type and name; the next ones its arguments)."""
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: list[DeltaToolCall] = []
    for event in events:
        if isinstance(event, CallStart):
            calls.append(
                DeltaToolCall(
                    index=event.index,
                    id=call_id(),
                    type="function",
                    function=DeltaFunctionCall(name=event.name, arguments=""),
                )
            )
        elif isinstance(event, ArgumentsDelta):
            if calls and calls[-1].index == event.index:
                calls[-1].function.arguments += event.text
            else:
                calls.append(
                    DeltaToolCall(
                        index=event.index, function=DeltaFunctionCall(arguments=event.text)
                    )
                )
    return DeltaMessage(
        content=content if content else msgspec.UNSET,
        tool_calls=calls if calls else msgspec.UNSET,
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
        tool_use = fmt.prepared.tool_use
        parsers = {i: tool_use.parser_for() for i in range(fmt.prepared.n)}
        called: set[int] = set()  # choices that made a tool call
        async for _, item in self.generation.start_pumps(task_group):
            if isinstance(item, RequestError):
                await emit(error_event(self.encoder, item))
                break
            prompt_tokens = max(prompt_tokens, item.num_prompt_tokens)
            output_tokens[item.index] = item.num_output_tokens
            if not (item.text or item.finish_reason or item.logprobs):
                continue
            parser = parsers[item.index]
            finish_reason: str | None = item.finish_reason
            if parser is None:
                delta = DeltaMessage(content=item.text) if item.text else DeltaMessage()
            else:
                events = parser.feed(item.text)
                if item.finish_reason is not None:
                    events += parser.finish()
                delta = tool_delta(events)
                if delta.tool_calls:
                    called.add(item.index)
                if item.index in called:
                    finish_reason = tool_calls_finish(finish_reason)
                if delta == DeltaMessage() and not (finish_reason or item.logprobs):
                    continue
            choice = ChatStreamChoice(
                index=item.index,
                delta=delta,
                logprobs=fmt.logprobs(item),
                finish_reason=finish_reason,
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
