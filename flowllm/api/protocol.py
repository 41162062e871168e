"""The OpenAI wire format as msgspec Structs: request bodies in, response bodies out.

Requests accept the OpenAI fields plus vLLM's sampling extras; unknown fields are ignored
(as OpenAI's SDK may send newer ones). Optional request fields default to None so an
explicit JSON `null` means "not given", and the defaults are resolved in one place
(`flowllm.api.convert`). Responses keep every field, `null` included, so their shapes are
exactly OpenAI's; fields that only some responses carry are UNSET and then left out.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

# ---------------------------------------------------------------------------------------
# Requests


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a message's content list; only `type: "text"` is supported."""

    type: str
    text: str | None = None


class ChatMessageParam(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields completions and chat share: OpenAI's, then vLLM's extras."""

    model: str | None = None  # None: the served model
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | None = None  # JSON keys are token ids as strings
    seed: int | None = None
    user: str | None = None  # accepted and ignored
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    cache_salt: str | None = None  # prefix-cache isolation: only requests with it share blocks


class CompletionRequest(_SamplingFields, kw_only=True):
    """POST /v1/completions."""

    prompt: str | list[Any]  # str, [str], [int] or [[int]]: checked by convert
    max_tokens: int | None = 16
    echo: bool | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    suffix: str | None = None  # not supported: 400 when given
    best_of: int | None = None  # not supported: 400 when given


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[ChatMessageParam]
    max_tokens: int | None = None  # None: the rest of the context
    max_completion_tokens: int | None = None  # wins over max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = None
    chat_template: str | None = None  # only with --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None  # same; extra template variables
    # Not supported; rejected with a clear 400 rather than silently ignored.
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """POST /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    chat_template: str | None = None  # only with --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None  # same; extra template variables


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """POST /detokenize."""

    tokens: list[int]
    model: str | None = None


# ---------------------------------------------------------------------------------------
# Responses


class UsageInfo(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        """The usage block of a response, its total computed."""
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class PromptLogprob(msgspec.Struct, kw_only=True):
    """vLLM's `prompt_logprobs` entry: one candidate for one prompt position."""

    logprob: float
    rank: int | None
    decoded_token: str


class CompletionLogProbs(msgspec.Struct, kw_only=True):
    """The legacy completions logprobs: parallel lists, one entry per returned token."""

    text_offset: list[int] = msgspec.field(default_factory=list)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)
    tokens: list[str] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = msgspec.field(default_factory=list)


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | UnsetType = UNSET


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    object: Literal["text_completion"] = "text_completion"


class CompletionStreamResponse(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: Literal["text_completion"] = "text_completion"
    usage: UsageInfo | UnsetType | None = UNSET  # present only with include_usage


class ChatTopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[ChatTopLogprob]


class ChatLogProbs(msgspec.Struct, kw_only=True):
    content: list[ChatTokenLogprob] | None


class ChatResponseMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    object: Literal["chat.completion"] = "chat.completion"


class DeltaMessage(msgspec.Struct, kw_only=True):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET


class ChatStreamChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionStreamResponse(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatStreamChoice]
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    usage: UsageInfo | UnsetType | None = UNSET  # present only with include_usage


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    created: int
    root: str
    max_model_len: int
    object: Literal["model"] = "model"
    owned_by: str = "flowllm"
    parent: str | None = None


class ModelList(msgspec.Struct, kw_only=True):
    data: list[ModelCard]
    object: Literal["list"] = "list"


class ErrorInfo(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    error: ErrorInfo


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


class VersionResponse(msgspec.Struct, kw_only=True):
    version: str
