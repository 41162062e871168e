"""The OpenAI wire format as msgspec Structs: request bodies in, response bodies out.

Requests accept the OpenAI fields this server implements plus vLLM's sampling extras, and
harmless metadata (`user`, `metadata`, `store`, `service_tier`, ...) that does not change
the output, which is accepted and ignored. Any other field is refused with a 400 naming it
(`forbid_unknown_fields`): fields OpenAI or vLLM define but this server does not implement
(`UNSUPPORTED_FIELDS`: legacy function calling, beam search...) as unsupported, anything
else as unrecognized, so no request is ever served while silently ignoring what it asked.
The OpenAI SDK sends only the fields its caller passes. Optional request fields default
to None so an explicit JSON `null` means "not given", and the defaults are resolved in one
place (`flowllm.api.convert`). Responses keep every field, `null` included, so their shapes are
exactly OpenAI's; fields that only some responses carry are UNSET and then left out.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

# ---------------------------------------------------------------------------------------
# Requests

# Fields OpenAI's or vLLM's API defines that this server does not implement: a request
# naming one is refused with a 400 saying so (`param` is the field), never served without.
UNSUPPORTED_FIELDS: dict[str, str] = {
    # OpenAI
    "functions": "function calling",
    "function_call": "function calling",
    "audio": "audio output",
    "prediction": "predicted outputs",
    "web_search_options": "web search",
    "reasoning_effort": "reasoning effort",
    "verbosity": "verbosity",
    # vLLM
    "guided_whitespace_pattern": "guided decoding whitespace patterns",
    "use_beam_search": "beam search",
    "length_penalty": "beam search",
    "logits_processors": "logits processors",
    "allowed_token_ids": "allowed_token_ids",
    "bad_words": "bad_words",
    "truncate_prompt_tokens": "prompt truncation",
    "prompt_embeds": "prompt embeddings",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids",
    "continue_final_message": "continue_final_message",
    "documents": "documents",
    "mm_processor_kwargs": "multimodal inputs",
    "priority": "request priorities",
    "kv_transfer_params": "KV transfer",
    "vllm_xargs": "vLLM extra arguments",
}


class _Request(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A request body (or part of one): a field it does not declare is a 400."""


class StreamOptions(_Request, kw_only=True):
    include_usage: bool | None = None  # a last chunk with the whole request's usage
    continuous_usage_stats: bool | None = None  # every chunk with its choice's usage so far
    include_obfuscation: bool | None = None  # accepted and ignored: no padding is sent


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a message's content list; only `type: "text"` is supported (other
    types, whatever fields they bring, are refused by type in flowllm.api.convert)."""

    type: str
    text: str | None = None


class FunctionCallParam(_Request, kw_only=True):
    name: str
    arguments: str  # JSON text


class ToolCallParam(_Request, kw_only=True):
    """A tool call an earlier assistant turn made."""

    id: str
    function: FunctionCallParam
    type: Literal["function"] = "function"


class ChatMessageParam(_Request, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None  # accepted and ignored
    refusal: str | None = None  # an earlier assistant turn's; accepted and ignored
    annotations: list[Any] | None = None  # likewise
    tool_calls: list[ToolCallParam] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    # Legacy function calling and audio turns are not supported: a 400 unless null.
    function_call: Any | None = None
    audio: Any | None = None


class JsonSchemaParam(_Request, kw_only=True):
    """`response_format.json_schema`."""

    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormatParam(_Request, kw_only=True):
    """`response_format`: text, json_object or json_schema."""

    type: str
    json_schema: JsonSchemaParam | None = None


class StructuredOutputsParam(_Request, kw_only=True):
    """vLLM's `structured_outputs`: exactly one of its constraints."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDefinition(_Request, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(_Request, kw_only=True):
    """One entry of `tools`."""

    type: str
    function: FunctionDefinition


class NamedFunction(_Request, kw_only=True):
    name: str


class NamedToolChoice(_Request, kw_only=True):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`."""

    type: str
    function: NamedFunction


class _SamplingFields(_Request, kw_only=True):
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
    user: str | None = None  # accepted and ignored (metadata)
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
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its
    # older guided_* fields (at most one of them; flowllm.api.convert).
    response_format: ResponseFormatParam | None = None
    structured_outputs: StructuredOutputsParam | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # only xgrammar (or "auto")


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
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' logprobs (not streamed)
    echo: bool | None = None  # vLLM's: the last message, if the answer's role, opens it
    add_generation_prompt: bool | None = None
    chat_template: str | None = None  # only with --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (bounded)
    # Metadata that does not change the output: accepted and ignored.
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    tools: list[ToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None  # only ["text"]


class TokenizeRequest(_Request, kw_only=True):
    """POST /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    chat_template: str | None = None  # only with --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (bounded)
    tools: list[ToolParam] | None = None  # rendered as a chat request's tools are


class DetokenizeRequest(_Request, kw_only=True):
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
    # present only with include_usage (null but on the last chunk) or continuous_usage_stats
    usage: UsageInfo | UnsetType | None = UNSET


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


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatResponseMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | None
    # With --reasoning-parser: the thinking part (null when none); absent without one.
    reasoning_content: str | UnsetType | None = UNSET
    tool_calls: list[ToolCall] | UnsetType = UNSET  # present when the model called tools


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
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | UnsetType = UNSET  # when asked


class DeltaFunctionCall(msgspec.Struct, kw_only=True):
    name: str | UnsetType = UNSET  # the call's first delta only
    arguments: str = ""


class DeltaToolCall(msgspec.Struct, kw_only=True):
    """A piece of one tool call: the first carries id, type and name, later ones only
    more of `arguments` (OpenAI's streaming shape)."""

    index: int
    id: str | UnsetType = UNSET
    type: Literal["function"] | UnsetType = UNSET
    function: DeltaFunctionCall


class DeltaMessage(msgspec.Struct, kw_only=True):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET  # more of the thinking part
    tool_calls: list[DeltaToolCall] | UnsetType = UNSET


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
    # present only with include_usage (null but on the last chunk) or continuous_usage_stats
    usage: UsageInfo | UnsetType | None = UNSET


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


# ---------------------------------------------------------------------------------------
# Pooling: embeddings (OpenAI's), scores (vLLM's), reranking (vLLM's, Jina's, Cohere's)


class EmbeddingRequest(_Request, kw_only=True):
    """POST /v1/embeddings."""

    input: str | list[Any]  # str, [str], [int] or [[int]]: checked by flowllm.api.pooling
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None  # None: float
    dimensions: int | None = None  # Matryoshka models: the first N values, renormalized
    user: str | None = None  # accepted and ignored (metadata)
    normalize: bool | None = None  # vLLM's: L2-normalize (None: as the model's pooler does)


class ScoreRequest(_Request, kw_only=True):
    """POST /v1/score (vLLM's): one text_1 against each text_2, or the lists pairwise."""

    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    user: str | None = None  # accepted and ignored


class RerankDocument(_Request, kw_only=True):
    """A document given as an object (Cohere's and Jina's form)."""

    text: str


class RerankRequest(_Request, kw_only=True):
    """POST /v1/rerank, /rerank, /v2/rerank: the documents ranked by relevance to query."""

    query: str
    documents: list[str | RerankDocument]
    model: str | None = None
    top_n: int | None = None  # the best N (None or 0: every document)
    return_documents: bool | None = None  # None: true, as vLLM and Jina
    user: str | None = None  # accepted and ignored


class PoolingUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(msgspec.Struct, kw_only=True):
    index: int
    embedding: list[float] | str  # base64: the float32 little-endian bytes
    object: Literal["embedding"] = "embedding"


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage
    object: Literal["list"] = "list"


class ScoreData(msgspec.Struct, kw_only=True):
    index: int
    score: float
    object: Literal["score"] = "score"


class ScoreResponse(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage
    object: Literal["list"] = "list"


class RerankedDocument(msgspec.Struct, kw_only=True):
    text: str


class RerankResult(msgspec.Struct, kw_only=True):
    index: int  # the document's in the request
    relevance_score: float
    document: RerankedDocument | UnsetType = UNSET  # unless return_documents is false


class RerankResponse(msgspec.Struct, kw_only=True):
    id: str
    model: str
    usage: PoolingUsage
    results: list[RerankResult]  # best first
