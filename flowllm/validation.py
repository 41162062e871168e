"""Request validation before the model runs: parameter ranges, model name, context length.

Plain functions over messages, free of I/O, so the graph's validate stage, the offline LLM
and tests apply exactly the same rules. Every failure is a `RequestError` carrying what an
OpenAI client expects to read: its kind, the offending `param` and a `code`
(OpenAI's codes, e.g. `decimal_above_max_value`, `context_length_exceeded`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from flowllm.config import EngineConfig, RequestLimits
from flowllm.messages import GenerateRequest, PoolingParams, RequestError, SamplingParams
from flowllm.models.pooler_config import PoolerConfig
from flowllm.sampling.grammar import constraint_kind, json_schema_text
from flowllm.text.chat_template import ChatTemplateError, check_template_kwargs

# OpenAI clamps logit_bias values to this range and rejects values outside it.
LOGIT_BIAS_LIMIT = 100.0
# repetition_penalty divides positive logits (multiplies negative ones) of seen tokens:
# beyond 2 a seen token is all but banned, which presence_penalty says more directly.
MAX_REPETITION_PENALTY = 2.0
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_SHOWN_DIGITS = 20  # a longer integer is shown abridged in an error message


class _Invalid(Exception):
    """One failed check (internal: becomes a RequestError for the request at hand)."""

    def __init__(self, message: str, param: str | None, code: str | None = "invalid_value") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def show_number(value: float) -> str:
    """A number as the user wrote it (3 not 3.0, 0.5 as 0.5), a huge integer abridged.

    Integers are never converted to float: a client's 400-digit integer must not overflow.
    """
    if isinstance(value, int):
        text = str(value) if abs(value) < 10**_SHOWN_DIGITS else _abridged(value)
        return text
    if math.isfinite(value) and value.is_integer() and abs(value) < 10**_SHOWN_DIGITS:
        return str(int(value))
    return repr(value)


def _abridged(value: int) -> str:
    digits = len(str(abs(value))) if value.bit_length() < 10_000 else None
    sign = "-" if value < 0 else ""
    if digits is None:  # str() of a huge int is itself slow: say only how big it is
        return f"{sign}an integer of {value.bit_length()} bits"
    head = str(abs(value))[:8]
    return f"{sign}{head}... ({digits} digits)"


def _at_least(name: str, value: float, low: float, *, integer: bool) -> None:
    if value < low:
        kind = "integer" if integer else "decimal"
        raise _Invalid(
            f"Invalid '{name}': {kind} below minimum value. Expected a value >= "
            f"{show_number(low)}, but got {show_number(value)} instead.",
            name,
            f"{kind}_below_min_value",
        )


def _at_most(name: str, value: float, high: float, *, integer: bool) -> None:
    if value > high:
        kind = "integer" if integer else "decimal"
        raise _Invalid(
            f"Invalid '{name}': {kind} above maximum value. Expected a value <= "
            f"{show_number(high)}, but got {show_number(value)} instead.",
            name,
            f"{kind}_above_max_value",
        )


def _finite(name: str, value: float) -> None:
    """NaN and infinities fail every range check silently or absurdly: say so."""
    if not isinstance(value, int) and not math.isfinite(value):
        raise _Invalid(
            f"Invalid '{name}': expected a finite number, but got {value!r} instead.",
            name,
            "invalid_value",
        )


def _in_range(name: str, value: float, low: float, high: float, *, integer: bool = False) -> None:
    if not integer:
        _finite(name, value)
    _at_least(name, value, low, integer=integer)
    _at_most(name, value, high, integer=integer)


def _at_most_entries(name: str, count: int, limit: int, what: str) -> None:
    if count > limit:
        raise _Invalid(
            f"Invalid '{name}': too many {what}. Expected at most {limit}, but got {count}.",
            name,
            "array_above_max_length",
        )


def _token_ids(name: str, ids: Sequence[int], vocab_size: int | None) -> None:
    """Every id in [0, vocab_size) (C-speed min/max first; integers compared as integers)."""
    if not ids:
        return
    low, high = min(ids), max(ids)
    if low < 0:
        raise _Invalid(
            f"Invalid '{name}': token ids cannot be negative, got {show_number(low)}.", name
        )
    if vocab_size is not None and high >= vocab_size:
        raise _Invalid(
            f"Invalid '{name}': token id {show_number(high)} is out of the vocabulary "
            f"(size {vocab_size}).",
            name,
        )


def check_n(n: int, limits: RequestLimits) -> None:
    """n in 1..max_n: checked before a mailbox for n choices is opened."""
    _in_range("n", n, 1, limits.max_n, integer=True)


def check_sampling_params(
    params: SamplingParams, limits: RequestLimits, vocab_size: int | None = None
) -> None:
    """Raise `_Invalid` for the first parameter outside the range OpenAI and vLLM allow.

    `vocab_size`: token ids must be below it (None: only their sign is checked).
    """
    check_n(params.n, limits)
    _in_range("temperature", params.temperature, 0.0, 2.0)
    _finite("top_p", params.top_p)
    if not 0.0 < params.top_p <= 1.0:
        raise _Invalid(
            f"Invalid 'top_p': expected a value in (0, 1], but got {show_number(params.top_p)} "
            "instead.",
            "top_p",
            "decimal_below_min_value" if params.top_p <= 0.0 else "decimal_above_max_value",
        )
    if params.top_k < -1:
        raise _Invalid(
            "Invalid 'top_k': expected -1 or 0 (disabled) or a value >= 1, but got "
            f"{show_number(params.top_k)} instead.",
            "top_k",
            "integer_below_min_value",
        )
    _in_range("min_p", params.min_p, 0.0, 1.0)
    if params.seed is not None:
        # A 64-bit integer, signed or not: what the generators take, and what crosses to
        # the engine core.
        _in_range("seed", params.seed, -(2**63), 2**64 - 1, integer=True)
    _in_range("presence_penalty", params.presence_penalty, -2.0, 2.0)
    _in_range("frequency_penalty", params.frequency_penalty, -2.0, 2.0)
    _finite("repetition_penalty", params.repetition_penalty)
    if not params.repetition_penalty > 0.0:
        raise _Invalid(
            "Invalid 'repetition_penalty': expected a value > 0, but got "
            f"{show_number(params.repetition_penalty)} instead.",
            "repetition_penalty",
            "decimal_below_min_value",
        )
    _at_most("repetition_penalty", params.repetition_penalty, MAX_REPETITION_PENALTY, integer=False)
    if params.max_tokens is not None:
        _at_least("max_tokens", params.max_tokens, 1, integer=True)
    _at_least("min_tokens", params.min_tokens, 0, integer=True)
    if params.max_tokens is not None and params.min_tokens > params.max_tokens:
        raise _Invalid(
            f"Invalid 'min_tokens': min_tokens ({show_number(params.min_tokens)}) must be less "
            f"than or equal to max_tokens ({show_number(params.max_tokens)}).",
            "min_tokens",
            "integer_above_max_value",
        )
    for name, value in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
        if value is not None:
            _in_range(name, value, 0, limits.max_logprobs, integer=True)
    _at_most_entries("stop", len(params.stop), limits.max_stop_strings, "stop strings")
    for stop in params.stop:
        if stop == "":
            raise _Invalid("Invalid 'stop': stop strings cannot be empty.", "stop", "empty_string")
        if len(stop) > limits.max_stop_string_length:
            raise _Invalid(
                f"Invalid 'stop': a stop string is {len(stop)} characters long; expected at "
                f"most {limits.max_stop_string_length}.",
                "stop",
                "string_above_max_length",
            )
    _at_most_entries(
        "stop_token_ids", len(params.stop_token_ids), limits.max_stop_token_ids, "token ids"
    )
    _token_ids("stop_token_ids", params.stop_token_ids, vocab_size)
    if params.logit_bias:
        _at_most_entries("logit_bias", len(params.logit_bias), limits.max_logit_bias, "entries")
        _token_ids("logit_bias", tuple(params.logit_bias), vocab_size)
        for bias in params.logit_bias.values():
            _in_range("logit_bias", bias, -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)


def check_structured_outputs(
    params: SamplingParams, limits: RequestLimits, vocab_size: int | None = None
) -> None:
    """A constraint names exactly one kind and is small enough to compile (the compile
    itself, which needs the tokenizer, is the validate stage's)."""
    spec = params.structured_outputs
    if spec is None:
        return
    param = spec.param
    if spec.after_reasoning is not None:
        tags = spec.after_reasoning
        _token_ids(f"{param}.after_reasoning", (tags.start, tags.end), vocab_size)
    kinds = constraint_kind(spec)
    if len(kinds) != 1:
        raise _Invalid(
            f"Invalid '{param}': exactly one of json, regex, choice, grammar and json_object "
            f"must be given, got {', '.join(kinds) if kinds else 'none'}.",
            param,
        )
    limit = limits.max_structured_output_chars
    if isinstance(spec.json, str) and len(spec.json) > limit:
        size = len(spec.json)  # too long to parse
    elif spec.json is not None:
        try:
            size = len(json_schema_text(spec.json))
        except (ValueError, RecursionError) as exc:
            raise _Invalid(f"Invalid '{param}': the JSON schema is not JSON: {exc}", param) from exc
    elif spec.choice is not None:
        if not spec.choice:
            raise _Invalid(
                f"Invalid '{param}': expected at least one choice.", param, "empty_array"
            )
        _at_most_entries(param, len(spec.choice), limits.max_choices, "choices")
        size = sum(len(c) for c in spec.choice)
    else:
        size = len(spec.regex or spec.grammar or "")
        if spec.json_object is False and size == 0:
            raise _Invalid(f"Invalid '{param}': the constraint is empty.", param, "empty_string")
    if size > limit:
        raise _Invalid(
            f"Invalid '{param}': the constraint is {size} characters long; expected at most "
            f"{limit}.",
            param,
            "string_above_max_length",
        )
    if params.min_tokens > 0:
        raise _Invalid(
            "Invalid 'min_tokens': it cannot be combined with a structured output constraint "
            "(the grammar decides where the output ends).",
            "min_tokens",
        )


def check_admission(
    requests: Sequence[GenerateRequest],
    limits: RequestLimits,
    max_model_len: int,
    *,
    max_choices: int,
    max_prompts: int,
) -> RequestError | None:
    """Can these requests (the prompts of one API request) ever be admitted together?

    Checked before anything is allocated for them: `n` in range, at most
    `max_prompts_per_request` prompts (and `max_prompts`, what the first channel holds),
    min_tokens at most max_tokens (the context length when unset), prompts x n x
    max_tokens within `max_request_tokens`, and prompts x n choices within
    `max_choices` (what admission ever holds). Integers are compared as integers.
    """
    if not requests:
        return None
    first = requests[0].request_id
    try:
        for request in requests:
            check_n(request.params.n, limits)
        prompt_limit = min(limits.max_prompts_per_request, max_prompts)
        _at_most_entries("prompt", len(requests), prompt_limit, "prompts")
        total = 0
        for request in requests:
            max_tokens = request.params.max_tokens
            most = max_model_len if max_tokens is None else max_tokens
            if most >= 1 and request.params.min_tokens > most:  # most < 1: validate says
                raise _Invalid(
                    f"Invalid 'min_tokens': min_tokens ({show_number(request.params.min_tokens)})"
                    f" must be less than or equal to max_tokens ({show_number(most)}; unset: "
                    "the context length).",
                    "min_tokens",
                    "integer_above_max_value",
                )
            total += request.params.n * most
        if total > limits.max_request_tokens:
            raise _Invalid(
                "Invalid 'max_tokens': this request asks for up to "
                f"{show_number(total)} tokens (prompts x n x max_tokens, max_tokens unset "
                f"counting as the context length {max_model_len}); expected at most "
                f"{limits.max_request_tokens}.",
                "max_tokens",
                "integer_above_max_value",
            )
        choices = sum(request.params.n for request in requests)
        if choices > max_choices:
            param = "n" if len(requests) == 1 else "prompt"
            raise _Invalid(
                f"Invalid '{param}': this request has {choices} choices (prompts x n), more "
                f"than the server ever admits at once ({max_choices}).",
                param,
                "integer_above_max_value",
            )
    except _Invalid as invalid:
        return _bad_request(first, invalid)
    return None


def check_tools(tools: tuple[dict[str, Any], ...] | None, limits: RequestLimits) -> None:
    """Each tool is a function with a name and, if any, an object of parameters."""
    if not tools:
        return
    _at_most_entries("tools", len(tools), limits.max_tools, "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise _Invalid(
                f'Invalid \'tools[{i}]\': expected {{"type": "function", "function": {{...}}}}.',
                f"tools[{i}]",
            )
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise _Invalid(
                f"Invalid 'tools[{i}].function.name': expected a string of letters, digits, "
                "underscores and dashes, at most 64 long.",
                f"tools[{i}].function.name",
            )
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise _Invalid(
                f"Invalid 'tools[{i}].function.parameters': expected a JSON schema object.",
                f"tools[{i}].function.parameters",
            )
    size = len(json_schema_text({"tools": list(tools)}))
    if size > limits.max_structured_output_chars:
        raise _Invalid(
            f"Invalid 'tools': the tools are {size} characters long as JSON; expected at most "
            f"{limits.max_structured_output_chars}.",
            "tools",
            "string_above_max_length",
        )


def tools_error(
    tools: tuple[dict[str, Any], ...] | None, limits: RequestLimits
) -> RequestError | None:
    """`check_tools` for tools that never enter the graph (`/tokenize`'s): the 400, or None."""
    try:
        check_tools(tools, limits)
    except _Invalid as invalid:
        return _bad_request("", invalid)
    return None


def _bad_request(request_id: str, invalid: _Invalid) -> RequestError:
    return RequestError(
        request_id=request_id,
        message=invalid.message,
        param=invalid.param,
        code=invalid.code,
    )


def _check_prompt(request: GenerateRequest, vocab_size: int | None) -> None:
    given = [
        name
        for name, value in (
            ("prompt", request.prompt),
            ("prompt_token_ids", request.prompt_token_ids),
            ("messages", request.messages),
        )
        if value is not None
    ]
    if len(given) != 1:
        raise _Invalid(
            "Exactly one of prompt, prompt_token_ids and messages must be given, got "
            f"{', '.join(given) if given else 'none'}.",
            "prompt",
        )
    # An empty prompt is refused by tokenize, which sees every prompt as tokens.
    if request.prompt_token_ids is not None:
        _token_ids("prompt", request.prompt_token_ids, vocab_size)
    if request.messages is not None and not request.messages:
        raise _Invalid(
            "Invalid 'messages': expected at least one message.", "messages", "empty_array"
        )


def check_task(request: GenerateRequest, pooler: PoolerConfig | None) -> None:
    """A request fits the task the model is served for: a pooling request (`pooling`) only
    a pooling model, a pair only a cross-encoder, text generation only a generating one."""
    if request.pooling is None and pooler is not None:
        raise _Invalid(
            f"This model is served for the '{pooler.task}' task (--task {pooler.task}): it "
            "does not generate text.",
            "model",
            "unsupported_task",
        )
    if request.pooling is not None and pooler is None:
        raise _Invalid(
            "This model is served for the 'generate' task: it makes no embeddings or "
            "scores (serve an embedding model with --task embed, a cross-encoder with "
            "--task score).",
            "model",
            "unsupported_task",
        )
    if request.text_pair is not None and (pooler is None or pooler.task != "score"):
        raise _Invalid("Only a cross-encoder (--task score) reads a pair of texts.", "text_pair")


def check_pooling(params: PoolingParams, pooler: PoolerConfig) -> None:
    """`dimensions` where the model allows it: 1 to its size, and for a model that is not
    Matryoshka-trained only its own size (a shorter vector would be poor), as vLLM rules."""
    dimensions = params.dimensions
    if dimensions is None:
        return
    _in_range("dimensions", dimensions, 1, pooler.size, integer=True)
    allowed = pooler.matryoshka_dimensions
    if not pooler.matryoshka and dimensions != pooler.size:
        raise _Invalid(
            "Invalid 'dimensions': this model does not support Matryoshka representations; "
            "changing its output dimensions would give poor results.",
            "dimensions",
        )
    if allowed and dimensions not in allowed and dimensions != pooler.size:
        raise _Invalid(
            f"Invalid 'dimensions': this model supports the dimensions {list(allowed)} only.",
            "dimensions",
        )


def model_not_found(request_id: str, model: str) -> RequestError:
    """vLLM's (and OpenAI's) answer to a `model` the server does not serve."""
    return RequestError(
        request_id=request_id,
        message=f"The model `{model}` does not exist.",
        kind="not_found",
        param="model",
        code="model_not_found",
    )


def constraint_error(request_id: str, message: str, param: str) -> RequestError:
    """The 400 of a constraint the grammar engine cannot compile (`message` is why)."""
    return RequestError(request_id=request_id, message=message, param=param, code="invalid_value")


def validate_request(
    request: GenerateRequest,
    config: EngineConfig,
    served_model_name: str,
    vocab_size: int | None = None,
    pooler: PoolerConfig | None = None,
) -> RequestError | None:
    """The first reason this request cannot run, or None when it is valid.

    `vocab_size`: the ids the model and tokenizer both know (prompt ids, stop_token_ids,
    logit_bias keys must be below it; None: only their sign is checked). `pooler`: the
    model's, when it is served for pooling. The context length needs the prompt's tokens,
    so it is checked later (by tokenize, with `check_context_length` or
    `check_pooling_length`).
    """
    if request.model != served_model_name:
        return model_not_found(request.request_id, request.model)
    try:
        check_task(request, pooler)
        if request.pooling is not None and pooler is not None:
            check_pooling(request.pooling, pooler)
        _check_prompt(request, vocab_size)
        check_sampling_params(request.params, config.limits, vocab_size)
        check_structured_outputs(request.params, config.limits, vocab_size)
        check_tools(request.tools, config.limits)
        check_template_kwargs(request.chat_template_kwargs, config.limits)
    except ChatTemplateError as error:
        return _bad_request(request.request_id, _Invalid(error.message, error.param, error.code))
    except _Invalid as invalid:
        return _bad_request(request.request_id, invalid)
    return None


def check_context_length(
    request_id: str, num_prompt_tokens: int, max_tokens: int | None, max_model_len: int
) -> tuple[int, RequestError | None]:
    """Resolve max_tokens (None: the rest of the context) and check prompt + output fit.

    Returns (resolved max_tokens, None) or (0, the error). A prompt must leave room for at
    least one generated token. Wording as vLLM's, code `context_length_exceeded`.
    """
    if max_tokens is None:
        if num_prompt_tokens >= max_model_len:
            message = (
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"your request has {num_prompt_tokens} input tokens. Please reduce the "
                "length of the input messages."
            )
            return 0, _context_error(request_id, message)
        return max_model_len - num_prompt_tokens, None
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {max_tokens} output tokens and your prompt contains "
            f"{num_prompt_tokens} input tokens, for a total of {total} tokens. Please reduce "
            "the length of the input prompt or the number of requested output tokens."
        )
        return 0, _context_error(request_id, message)
    return max_tokens, None


def check_pooling_length(
    request_id: str, num_prompt_tokens: int, max_model_len: int
) -> RequestError | None:
    """A pooling request's prompt fits the context (it generates nothing, so it may fill
    it). Wording as vLLM's."""
    if num_prompt_tokens <= max_model_len:
        return None
    message = (
        f"This model's maximum context length is {max_model_len} tokens. However, you "
        f"requested {num_prompt_tokens} tokens in the input for embedding generation. Please "
        "reduce the length of the input."
    )
    return _context_error(request_id, message)


def _context_error(request_id: str, message: str) -> RequestError:
    return RequestError(
        request_id=request_id,
        message=message,
        param="input_tokens",
        code="context_length_exceeded",
    )
