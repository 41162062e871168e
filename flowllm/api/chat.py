"""Chat completion responses (`chat.completion`, `chat.completion.chunk`) from chunks.

Streaming opens every choice with a chunk carrying `delta.role`, then (with `echo`) one
carrying the echoed last message, then content deltas; the last delta of a choice carries
its finish_reason. Each choice's output is read by a `ChoiceReader`: with a reasoning
parser (flowllm.text.reasoning) its thinking part becomes `reasoning_content` and only the
answer is read on; with tool calls (flowllm.api.tool_calls) the answer is parsed as it
streams, deltas carry content and `tool_calls` pieces, and a choice that called tools and
stopped finishes with "tool_calls". A whole response is read the same way, so both agree.
With `continuous_usage_stats`, every chunk carries its choice's usage so far, as vLLM's.
"""

from __future__ import annotations

import msgspec
from anyio.abc import TaskGroup

from flowllm.api.completions import DONE, error_event, sse
from flowllm.api.convert import PreparedChat
from flowllm.api.logprobs import chat_logprobs, prompt_logprobs_entries
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
    ToolCallParser,
    call_id,
)
from flowllm.messages import Chunk, RequestError
from flowllm.text.reasoning import ReasoningSplitter


class ChoiceReader:
    """One choice's output text, fed in pieces: its thinking, and its answer as the
    tool-call parser's events (content events only, without a parser)."""

    def __init__(self, reasoning: ReasoningSplitter | None, tools: ToolCallParser | None):
        self._reasoning = reasoning
        self._tools = tools

    def read(self, text: str, final: bool) -> tuple[str, list[Event]]:
        """(thinking, answer events) of the next piece; `final`: the output ends with it."""
        thinking, answer = "", text
        if self._reasoning is not None:
            thinking, answer = self._reasoning.feed(text)
            if final:
                more_thinking, more_answer = self._reasoning.finish()
                thinking, answer = thinking + more_thinking, answer + more_answer
        if self._tools is None:
            return thinking, [ContentDelta(answer)] if answer else []
        events = self._tools.feed(answer) if answer else []
        if final:
            events += self._tools.finish()
        return thinking, events


class ChatFormat(ResponseFormat[PreparedChat]):
    """How one chat request's chunks become OpenAI chat choices."""

    def logprobs(self, chunk: Chunk) -> ChatLogProbs | None:
        if self.prepared.logprobs is None:
            return None
        return ChatLogProbs(
            content=chat_logprobs(self.texts, chunk.logprobs, self.prepared.logprobs)
        )

    def reader(self) -> ChoiceReader:
        """A fresh reader for one choice's output."""
        reasoning = self.prepared.reasoning
        return ChoiceReader(
            reasoning.splitter() if reasoning is not None else None,
            self.prepared.tool_use.parser_for(),
        )

    def message(self, chunk: Chunk) -> tuple[ChatResponseMessage, str | None]:
        """A whole choice's message and finish_reason (thinking and tool calls parsed)."""
        prepared = self.prepared
        thinking, events = self.reader().read(chunk.text, final=True)
        parsed = ParsedOutput()
        parsed.add(events)
        text = prepared.echo + parsed.content
        with_parser = prepared.reasoning is not None
        # What a stream of this output sends as content; null when the output is all
        # thinking or tool calls (vLLM's), "" when a plain output is empty.
        content = text if text or not (parsed.calls or with_parser) else None
        message = ChatResponseMessage(
            role=prepared.role,
            content=content,
            reasoning_content=(thinking or None) if with_parser else msgspec.UNSET,
        )
        if not parsed.calls:
            return message, chunk.finish_reason
        message.tool_calls = [
            ToolCall(id=call_id(), function=FunctionCall(name=name, arguments=arguments))
            for name, arguments in parsed.calls
        ]
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
        response = ChatCompletionResponse(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=UsageInfo.of(prompt_tokens, completion_tokens),
        )
        top = self.prepared.prompt_logprobs
        if top is not None:  # the prompt's, which every choice shares: the first one's
            first = merged[min(merged)].prompt_logprobs if merged else ()
            response.prompt_logprobs = prompt_logprobs_entries(self.texts, first, top)
        return response


def tool_calls_finish(finish_reason: str | None) -> str | None:
    """A choice that called tools and stopped by itself finishes with "tool_calls"."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def stream_delta(thinking: str, events: list[Event]) -> DeltaMessage:
    """One stream delta: thinking, content, and OpenAI's tool-call pieces (a call's first
    piece carries its id, type and name; the next ones its arguments)."""
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
        reasoning_content=thinking if thinking else msgspec.UNSET,
        tool_calls=calls if calls else msgspec.UNSET,
    )


class ChatStream(EventSource):
    """The SSE body of a streamed chat completion."""

    def __init__(self, generation: Generation, fmt: ChatFormat, encoder: msgspec.json.Encoder):
        self.generation = generation
        self.fmt = fmt
        self.encoder = encoder
        self._prompt_tokens = 0
        self._output_tokens: dict[int, int] = {}  # choice index -> tokens generated so far

    def _usage(self, index: int) -> UsageInfo:
        return UsageInfo.of(self._prompt_tokens, self._output_tokens.get(index, 0))

    def _event(self, choice: ChatStreamChoice) -> bytes:
        """One choice's chunk: usage so far with continuous usage stats, else a null usage
        when the last chunk will carry it."""
        prepared = self.fmt.prepared
        usage: UsageInfo | msgspec.UnsetType | None = msgspec.UNSET
        if prepared.continuous_usage:
            usage = self._usage(choice.index)
        elif prepared.include_usage:
            usage = None
        return sse(self.encoder, self._chunk([choice], usage))

    def _chunk(
        self, choices: list[ChatStreamChoice], usage: UsageInfo | msgspec.UnsetType | None
    ) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(
            id=self.fmt.response_id,
            created=self.fmt.created,
            model=self.fmt.model,
            choices=choices,
            usage=usage,
        )

    async def run(self, emit: Emit, task_group: TaskGroup) -> None:
        fmt = self.fmt
        prepared = fmt.prepared
        first = self.generation.first_chunks[0] if self.generation.first_chunks else None
        self._prompt_tokens = first.num_prompt_tokens if first is not None else 0
        for index in range(prepared.n):
            delta = DeltaMessage(role=prepared.role, content="")
            await emit(self._event(ChatStreamChoice(index=index, delta=delta)))
        if prepared.echo:
            for index in range(prepared.n):
                delta = DeltaMessage(content=prepared.echo)
                await emit(self._event(ChatStreamChoice(index=index, delta=delta)))
        readers = {i: fmt.reader() for i in range(prepared.n)}
        called: set[int] = set()  # choices that made a tool call
        async for _, item in self.generation.start_pumps(task_group):
            if isinstance(item, RequestError):
                await emit(error_event(self.encoder, item))
                break
            self._prompt_tokens = max(self._prompt_tokens, item.num_prompt_tokens)
            self._output_tokens[item.index] = item.num_output_tokens
            if not (item.text or item.finish_reason or item.logprobs):
                continue
            final = item.finish_reason is not None
            delta = stream_delta(*readers[item.index].read(item.text, final))
            if delta.tool_calls:
                called.add(item.index)
            finish_reason: str | None = item.finish_reason
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
            await emit(self._event(choice))
        else:
            if prepared.include_usage:
                completion_tokens = sum(self._output_tokens.values())
                usage = UsageInfo.of(self._prompt_tokens, completion_tokens)
                await emit(sse(self.encoder, self._chunk([], usage)))
        await emit(DONE)

    def close(self) -> None:
        self.generation.close()
