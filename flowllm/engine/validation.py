"""Request validation before the model runs: parameter ranges, model name, context length.

Plain functions over messages, free of I/O, so the graph's validate stage, the offline LLM
and tests apply exactly the same rules. Every failure is a `RequestError` carrying what an
OpenAI client expects to read: HTTP status, error type, the offending `param` and a `code`
(OpenAI's codes, e.g. `decimal_above_max_value`, `context_length_exceeded`).
"""

from __future__ import annotations

from flowllm.config import EngineConfig
from flowllm.messages import GenerateRequest, RequestError, SamplingParams

# OpenAI clamps logit_bias values to this range and rejects values outside it.
LOGIT_BIAS_LIMIT = 100.0


class _Invalid(Exception):
    """One failed check (internal: becomes a RequestError for the request at hand)."""

    def __init__(self, message: str, param: str | None, code: str | None = "invalid_value") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def _number(value: float) -> str:
    """A number as the user wrote it: 3 not 3.0, 0.5 as 0.5."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _at_least(name: str, value: float, low: float, *, integer: bool) -> None:
    if value < low:
        kind = "integer" if integer else "decimal"
        raise _Invalid(
            f"Invalid '{name}': {kind} below minimum value. Expected a value >= "
            f"{_number(low)}, but got {_number(value)} instead.",
            name,
            f"{kind}_below_min_value",
        )


def _at_most(name: str, value: float, high: float, *, integer: bool) -> None:
    if value > high:
        kind = "integer" if integer else "decimal"
        raise _Invalid(
            f"Invalid '{name}': {kind} above maximum value. Expected a value <= "
            f"{_number(high)}, but got {_number(value)} instead.",
            name,
            f"{kind}_above_max_value",
        )


def _in_range(name: str, value: float, low: float, high: float, *, integer: bool = False) -> None:
    _at_least(name, value, low, integer=integer)
    _at_most(name, value, high, integer=integer)


def check_sampling_params(params: SamplingParams, config: EngineConfig) -> None:
    """Raise `_Invalid` for the first parameter outside the range OpenAI and vLLM allow."""
    _in_range("n", params.n, 1, config.max_n, integer=True)
    _in_range("temperature", params.temperature, 0.0, 2.0)
    if not 0.0 < params.top_p <= 1.0:
        raise _Invalid(
            f"Invalid 'top_p': expected a value in (0, 1], but got {_number(params.top_p)} "
            "instead.",
            "top_p",
            "decimal_below_min_value" if params.top_p <= 0.0 else "decimal_above_max_value",
        )
    if params.top_k < -1:
        raise _Invalid(
            "Invalid 'top_k': expected -1 or 0 (disabled) or a value >= 1, but got "
            f"{params.top_k} instead.",
            "top_k",
            "integer_below_min_value",
        )
    _in_range("min_p", params.min_p, 0.0, 1.0)
    _in_range("presence_penalty", params.presence_penalty, -2.0, 2.0)
    _in_range("frequency_penalty", params.frequency_penalty, -2.0, 2.0)
    if not params.repetition_penalty > 0.0:
        raise _Invalid(
            "Invalid 'repetition_penalty': expected a value > 0, but got "
            f"{_number(params.repetition_penalty)} instead.",
            "repetition_penalty",
            "decimal_below_min_value",
        )
    if params.max_tokens is not None:
        _at_least("max_tokens", params.max_tokens, 1, integer=True)
    _at_least("min_tokens", params.min_tokens, 0, integer=True)
    if params.max_tokens is not None and params.min_tokens > params.max_tokens:
        raise _Invalid(
            f"Invalid 'min_tokens': min_tokens ({params.min_tokens}) must be less than or "
            f"equal to max_tokens ({params.max_tokens}).",
            "min_tokens",
            "integer_above_max_value",
        )
    for name, value in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
        if value is not None:
            _in_range(name, value, 0, config.max_logprobs, integer=True)
    if any(s == "" for s in params.stop):
        raise _Invalid("Invalid 'stop': stop strings cannot be empty.", "stop", "empty_string")
    if any(t < 0 for t in params.stop_token_ids):
        raise _Invalid("Invalid 'stop_token_ids': token ids cannot be negative.", "stop_token_ids")
    if params.logit_bias:
        for token_id, bias in params.logit_bias.items():
            if token_id < 0:
                raise _Invalid(
                    f"Invalid 'logit_bias': token id {token_id} cannot be negative.",
                    "logit_bias",
                )
            _in_range("logit_bias", bias, -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)


def _check_prompt(request: GenerateRequest) -> None:
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
    if request.prompt is not None and request.prompt == "":
        raise _Invalid("The prompt cannot be empty.", "prompt", "empty_string")
    if request.prompt_token_ids is not None:
        if not request.prompt_token_ids:
            raise _Invalid("The prompt cannot be empty.", "prompt", "empty_array")
        if min(request.prompt_token_ids) < 0:
            raise _Invalid("Invalid 'prompt': token ids cannot be negative.", "prompt")
    if request.messages is not None and not request.messages:
        raise _Invalid(
            "Invalid 'messages': expected at least one message.", "messages", "empty_array"
        )


def model_not_found(request_id: str, model: str) -> RequestError:
    """vLLM's (and OpenAI's) answer to a `model` the server does not serve."""
    return RequestError(
        request_id=request_id,
        message=f"The model `{model}` does not exist.",
        type="NotFoundError",
        param="model",
        code="model_not_found",
        status_code=404,
    )


def validate_request(
    request: GenerateRequest, config: EngineConfig, served_model_name: str
) -> RequestError | None:
    """The first reason this request cannot run, or None when it is valid.

    Token ids out of the vocabulary and the context length need the tokenizer, so they
    are checked later (by tokenize, with `check_context_length`).
    """
    if request.model != served_model_name:
        return model_not_found(request.request_id, request.model)
    try:
        _check_prompt(request)
        check_sampling_params(request.params, config)
    except _Invalid as invalid:
        return RequestError(
            request_id=request.request_id,
            message=invalid.message,
            type="BadRequestError",
            param=invalid.param,
            code=invalid.code,
            status_code=400,
        )
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


def _context_error(request_id: str, message: str) -> RequestError:
    return RequestError(
        request_id=request_id,
        message=message,
        type="BadRequestError",
        param="input_tokens",
        code="context_length_exceeded",
        status_code=400,
    )
