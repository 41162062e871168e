"""OpenAI request bodies -> `GenerateRequest`s for the graph, with the API's defaults.

Only what the schema cannot express is checked here (prompt shapes, unsupported options,
content parts); parameter ranges are the graph's validate stage's job
(`flowllm.validation`), so the HTTP API and the offline API share one set of rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from flowllm.api.errors import ApiError
from flowllm.api.protocol import (
    ChatCompletionRequest,
    ChatMessageParam,
    CompletionRequest,
)
from flowllm.api.tool_calls import ToolUse, tool_use
from flowllm.messages import (
    ChatMessage,
    GenerateRequest,
    ReasoningTokens,
    SamplingParams,
    StructuredOutputs,
    ToolCall,
)
from flowllm.text.reasoning import ReasoningParser
from flowllm.validation import show_number

ASSISTANT = "assistant"
CHAT_ROLES = ("system", "developer", "user", ASSISTANT, "tool")
GUIDED_BACKENDS = (None, "auto", "xgrammar")  # guided_decoding_backend values served


@dataclass(frozen=True)
class ChatReasoning:
    """The server's `--reasoning-parser`, and its tags as the served tokenizer's tokens
    (None: the tokenizer does not hold each as one token)."""

    parser: ReasoningParser
    tokens: ReasoningTokens | None

    @classmethod
    def of(cls, name: str | None, tokenizer: Any) -> ChatReasoning | None:
        if name is None:
            return None
        parser = ReasoningParser.named(name)
        return cls(parser, parser.tokens(tokenizer))


class PreparedCompletion(msgspec.Struct, frozen=True, kw_only=True):
    """A completion request split per prompt, as the graph will see it."""

    requests: tuple[GenerateRequest, ...]
    n: int  # choices per prompt: choice index = prompt_index * n + choice
    echo: bool
    echo_only: bool  # max_tokens 0 with echo: return the prompt, drop the generated token
    logprobs: int | None  # top-N per returned token, None: no logprobs
    prompt_logprobs: int | None  # vLLM's prompt_logprobs field, as asked
    include_usage: bool
    continuous_usage: bool = False  # every streamed chunk carries usage so far


class PreparedChat(msgspec.Struct, frozen=True, kw_only=True):
    request: GenerateRequest
    n: int
    logprobs: int | None  # top_logprobs when logprobs is true, else None
    include_usage: bool
    continuous_usage: bool = False  # every streamed chunk carries usage so far
    tool_use: ToolUse = ToolUse(mode="none", tools=None, constraint=None)
    reasoning: ReasoningParser | None = None  # splits the thinking part from the answer
    role: str = ASSISTANT  # the answer's role (the last message's without a generation prompt)
    echo: str = ""  # echo: the last message's content, which opens the answer
    prompt_logprobs: int | None = None  # the response's prompt_logprobs, top-N


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _stream_flags(stream: bool | None, options: Any) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous usage); stream_options without stream is a 400,
    as in vLLM. `continuous_usage_stats` puts usage in every chunk with or without
    `include_usage` (vLLM wants both)."""
    if options is None:
        return bool(stream), False, False
    if not stream:
        raise ApiError(
            "Stream options can only be defined when `stream=True`.", param="stream_options"
        )
    return True, bool(options.include_usage), bool(options.continuous_usage_stats)


def _common_params(req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    """SamplingParams fields both endpoints set the same way (None: the engine default)."""
    values: dict[str, Any] = {
        "n": req.n,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "logit_bias": req.logit_bias,
        "seed": req.seed,
        "min_tokens": req.min_tokens,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        "spaces_between_special_tokens": req.spaces_between_special_tokens,
    }
    fields = {k: v for k, v in values.items() if v is not None}
    fields["stop"] = _stop(req.stop)
    fields["stop_token_ids"] = tuple(req.stop_token_ids or ())
    return fields


def structured_outputs(req: CompletionRequest | ChatCompletionRequest) -> StructuredOutputs | None:
    """The request's output constraint, from whichever field gave it (at most one may)."""
    found: list[StructuredOutputs] = []
    fmt = req.response_format
    if fmt is not None:
        if fmt.type == "json_object":
            found.append(StructuredOutputs(json_object=True, param="response_format"))
        elif fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema is None:
                raise ApiError(
                    "Invalid 'response_format': type json_schema needs `json_schema.schema`.",
                    param="response_format.json_schema",
                )
            found.append(
                StructuredOutputs(
                    json=fmt.json_schema.schema, param="response_format.json_schema.schema"
                )
            )
        elif fmt.type != "text":
            raise ApiError(
                f"Invalid 'response_format.type': expected text, json_object or json_schema, "
                f"got {fmt.type!r}.",
                param="response_format.type",
            )
    so = req.structured_outputs
    if so is not None:
        found.append(
            StructuredOutputs(
                json=so.json,
                regex=so.regex,
                choice=tuple(so.choice) if so.choice is not None else None,
                grammar=so.grammar,
                json_object=bool(so.json_object),
            )
        )
    for param, field in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(req, param)
        if value is not None:
            if isinstance(value, list):
                value = tuple(value)
            found.append(StructuredOutputs(**{field: value}, param=param))
    if req.guided_decoding_backend not in GUIDED_BACKENDS:
        raise ApiError(
            f"Invalid 'guided_decoding_backend': this server uses xgrammar, not "
            f"{req.guided_decoding_backend!r}.",
            param="guided_decoding_backend",
        )
    if len(found) > 1:
        raise ApiError(
            f"Only one output constraint may be given; got {', '.join(f.param for f in found)}.",
            param=found[1].param,
        )
    return found[0] if found else None


UNTRUSTED_CHAT_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)


def check_request_template(chat_template: str | None, trusted: bool) -> None:
    """A request's own template (code): a 400 unless trusted. Its template variables
    (`chat_template_kwargs`, data) are taken from any client, bounded by the limits."""
    if chat_template is not None and not trusted:
        raise ApiError(
            UNTRUSTED_CHAT_TEMPLATE, param="chat_template", code="untrusted_chat_template"
        )


def template_kwargs(
    given: dict[str, Any] | None, defaults: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The template variables a chat renders with: the server's defaults
    (`--default-chat-template-kwargs`), overridden by the request's own."""
    merged = {**(defaults or {}), **(given or {})}
    return merged or None


def _cache_salt(salt: str | None) -> str | None:
    if salt is not None and not salt:
        raise ApiError(
            "Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt"
        )
    return salt


def split_prompts(prompt: str | list[Any], param: str = "prompt") -> list[str | tuple[int, ...]]:
    """The prompts of a completion request (or the inputs of an embeddings request, the
    field `param`): a string, strings, token ids, or id lists."""
    bad = ApiError(
        f"Invalid '{param}': expected a string, an array of strings, an array of token ids "
        "or an array of token id arrays.",
        param=param,
        code="invalid_type",
    )
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        return [()]  # one prompt of no tokens, refused as every empty prompt is
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [tuple(prompt)]
    if all(isinstance(p, list) for p in prompt):
        prompts: list[str | tuple[int, ...]] = []
        for ids in prompt:
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise bad
            prompts.append(tuple(ids))
        return prompts
    raise bad


def prepare_completion(
    req: CompletionRequest,
    *,
    request_id: str,
    served_model_name: str,
    arrival_time: float,
) -> tuple[PreparedCompletion, bool]:
    """The graph requests for one completion request, and whether it streams.

    `max_tokens: 0` with `echo` runs the prompt with max_tokens 1 (the engine needs one
    step to compute prompt logprobs) and the generated token is dropped when formatting.
    """
    if req.suffix is not None:
        raise ApiError("suffix is not currently supported", param="suffix")
    if req.best_of is not None and req.best_of != 1:
        raise ApiError("best_of is not currently supported", param="best_of")
    stream, include_usage, continuous_usage = _stream_flags(req.stream, req.stream_options)
    echo = bool(req.echo)
    echo_only = echo and req.max_tokens == 0
    fields = _common_params(req)
    fields["structured_outputs"] = structured_outputs(req)
    fields["max_tokens"] = 1 if echo_only else req.max_tokens
    if echo_only:
        fields["min_tokens"] = 0
    if req.logprobs is not None:
        fields["logprobs"] = req.logprobs
    prompt_logprobs = req.prompt_logprobs
    if echo and req.logprobs is not None:
        # Every echoed prompt token gets its logprob (and top-N), aligned with generated ones.
        prompt_logprobs = max(req.logprobs, prompt_logprobs or 0)
    if prompt_logprobs is not None:
        fields["prompt_logprobs"] = prompt_logprobs
    try:
        params = SamplingParams(**fields)
    except TypeError as exc:  # a wrong type the schema let through (cannot happen normally)
        raise ApiError(f"Invalid request: {exc}") from exc
    model = req.model or served_model_name
    salt = _cache_salt(req.cache_salt)
    requests = []
    for i, prompt in enumerate(split_prompts(req.prompt)):
        requests.append(
            GenerateRequest(
                request_id=f"{request_id}-{i}",
                model=model,
                params=params,
                arrival_time=arrival_time,
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=prompt if isinstance(prompt, tuple) else None,
                echo=echo,
                cache_salt=salt,
            )
        )
    prepared = PreparedCompletion(
        requests=tuple(requests),
        n=params.n,
        echo=echo,
        echo_only=echo_only,
        logprobs=req.logprobs,
        prompt_logprobs=req.prompt_logprobs,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
    )
    return prepared, stream


def flatten_messages(messages: list[ChatMessageParam]) -> tuple[ChatMessage, ...]:
    """Chat turns with content as one string: text parts joined, anything else a 400."""
    flat = []
    for i, message in enumerate(messages):
        for name in ("function_call", "audio"):
            if getattr(message, name) is not None:
                raise ApiError.unsupported(
                    f"messages[{i}].{name}", "legacy function calling or audio turns"
                )
        if message.tool_calls and message.role != "assistant":
            raise ApiError(
                f"Invalid 'messages[{i}].tool_calls': only assistant messages carry tool calls.",
                param=f"messages[{i}].tool_calls",
            )
        if message.role == "tool" and message.tool_call_id is None:
            raise ApiError(
                f"Invalid 'messages[{i}]': a tool message needs `tool_call_id`.",
                param=f"messages[{i}].tool_call_id",
            )
        if message.role not in CHAT_ROLES:
            raise ApiError(
                f"Invalid 'messages[{i}].role': {message.role!r} is not supported; expected "
                f"one of {', '.join(CHAT_ROLES)}.",
                param=f"messages[{i}].role",
            )
        content = message.content
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        else:
            parts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise ApiError(
                        f"Invalid 'messages[{i}].content[{j}]': content parts of type "
                        f"{part.type!r} are not supported; only text parts are.",
                        param=f"messages[{i}].content[{j}].type",
                    )
                parts.append(part.text)
            text = "\n".join(parts)
        calls = tuple(
            ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
            for c in message.tool_calls or ()
        )
        tool_call_id = message.tool_call_id if message.role == "tool" else None
        flat.append(ChatMessage(message.role, text, calls, tool_call_id))
    return tuple(flat)


def prepare_chat(
    req: ChatCompletionRequest,
    *,
    request_id: str,
    served_model_name: str,
    arrival_time: float,
    chat_template: str | None,
    max_logprobs: int | None = None,
    trust_request_chat_template: bool = False,
    tool_parser: str | None = None,
    reasoning: ChatReasoning | None = None,
    default_template_kwargs: dict[str, Any] | None = None,
) -> tuple[PreparedChat, bool]:
    """The graph request for one chat request, and whether it streams.

    `top_logprobs` becomes the engine's `logprobs`: its range is checked here (against
    `max_logprobs`), so that a refusal names the field the client sent. `tool_parser`:
    the server's `--tool-call-parser` when auto tool choice is enabled. `reasoning`: the
    server's `--reasoning-parser`; an output constraint (structured outputs, or a tool
    choice's) then starts after the thinking part. `default_template_kwargs`: the
    server's template variables, which the request's own override.
    """
    check_request_template(req.chat_template, trust_request_chat_template)
    tools = tool_use(req, tool_parser)
    constraint = structured_outputs(req)
    if tools.constraint is not None:
        if constraint is not None:
            raise ApiError(
                f"tool_choice {tools.mode!r} cannot be combined with '{constraint.param}'.",
                param=constraint.param,
            )
        constraint = tools.constraint
    if constraint is not None and reasoning is not None:
        constraint = _after_reasoning(constraint, reasoning)
    if req.modalities is not None and any(m != "text" for m in req.modalities):
        raise ApiError.unsupported("modalities", "output modalities other than text")
    top = req.top_logprobs
    if top is not None and max_logprobs is not None and not 0 <= top <= max_logprobs:
        raise ApiError(
            f"Invalid 'top_logprobs': expected a value in [0, {max_logprobs}], but got "
            f"{show_number(top)} instead.",
            param="top_logprobs",
            code="integer_above_max_value" if top > 0 else "integer_below_min_value",
        )
    if req.top_logprobs is not None and req.top_logprobs > 0 and not req.logprobs:
        raise ApiError(
            "when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs"
        )
    stream, include_usage, continuous_usage = _stream_flags(req.stream, req.stream_options)
    if req.prompt_logprobs is not None and stream:
        raise ApiError(
            "`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs"
        )
    fields = _common_params(req)
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    fields["max_tokens"] = max_tokens  # None: the engine resolves it to the rest of the context
    fields["structured_outputs"] = constraint
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if logprobs is not None:
        fields["logprobs"] = logprobs
    if req.prompt_logprobs is not None:
        fields["prompt_logprobs"] = req.prompt_logprobs
    params = SamplingParams(**fields)
    messages = flatten_messages(req.messages)
    add_generation_prompt = True if req.add_generation_prompt is None else req.add_generation_prompt
    # vLLM's rule: without a generation prompt the answer continues the last message's
    # role, and `echo` repeats the last message when it has the answer's role.
    role = ASSISTANT if add_generation_prompt or not messages else messages[-1].role
    echo = messages[-1].content if req.echo and messages and messages[-1].role == role else ""
    request = GenerateRequest(
        request_id=request_id,
        model=req.model or served_model_name,
        params=params,
        arrival_time=arrival_time,
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        chat_template=req.chat_template if req.chat_template is not None else chat_template,
        chat_template_kwargs=template_kwargs(req.chat_template_kwargs, default_template_kwargs),
        tools=tools.tools,
        cache_salt=_cache_salt(req.cache_salt),
    )
    prepared = PreparedChat(
        request=request,
        n=params.n,
        logprobs=logprobs,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        tool_use=tools,
        reasoning=reasoning.parser if reasoning is not None else None,
        role=role,
        echo=echo,
        prompt_logprobs=req.prompt_logprobs,
    )
    return prepared, stream


def _after_reasoning(constraint: StructuredOutputs, reasoning: ChatReasoning) -> StructuredOutputs:
    """The constraint, applied from the token after the thinking part; a 400 when the
    tokenizer cannot say where that part ends."""
    if reasoning.tokens is None:
        raise ApiError(
            f"'{constraint.param}' cannot be combined with --reasoning-parser "
            f"{reasoning.parser.name} on this model: its tokenizer does not hold <think> and "
            "</think> as single tokens, so the constraint cannot start after the thinking "
            "part.",
            param=constraint.param,
        )
    return msgspec.structs.replace(constraint, after_reasoning=reasoning.tokens)
