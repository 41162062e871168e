"""validate_request and check_context_length: every range, its status, type, param, code."""

from __future__ import annotations

from typing import Any

import pytest

from flowllm.config import EngineConfig
from flowllm.engine.validation import check_context_length, validate_request
from flowllm.messages import ChatMessage, GenerateRequest, SamplingParams

MODEL = "m"
CONFIG = EngineConfig(max_logprobs=20, max_n=16)


def request(**kwargs: Any) -> GenerateRequest:
    params = kwargs.pop("params", {})
    fields: dict[str, Any] = {
        "request_id": "r1",
        "model": MODEL,
        "params": SamplingParams(**params),
        "arrival_time": 0.0,
    }
    if not {"prompt", "prompt_token_ids", "messages"} & kwargs.keys():
        fields["prompt"] = "hello"
    fields.update(kwargs)
    return GenerateRequest(**fields)


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0},
        {"temperature": 2.0, "top_p": 1e-6, "top_k": 0, "min_p": 1.0},
        {"top_k": 1, "presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"repetition_penalty": 1e-3, "n": 16, "max_tokens": 1, "min_tokens": 1},
        {"max_tokens": None, "min_tokens": 50},
        {"logprobs": 0, "prompt_logprobs": 20, "stop": ("x", "\n"), "stop_token_ids": (0,)},
        {"logit_bias": {5: 100.0, 6: -100.0}, "seed": -3},
    ],
)
def test_valid_requests_pass(params: dict[str, Any]) -> None:
    assert validate_request(request(params=params), CONFIG, MODEL) is None


@pytest.mark.parametrize(
    ("params", "param", "code"),
    [
        ({"n": 0}, "n", "integer_below_min_value"),
        ({"n": 17}, "n", "integer_above_max_value"),
        ({"temperature": -0.1}, "temperature", "decimal_below_min_value"),
        ({"temperature": 2.01}, "temperature", "decimal_above_max_value"),
        ({"top_p": 0.0}, "top_p", "decimal_below_min_value"),
        ({"top_p": 1.5}, "top_p", "decimal_above_max_value"),
        ({"top_k": -2}, "top_k", "integer_below_min_value"),
        ({"min_p": -0.01}, "min_p", "decimal_below_min_value"),
        ({"min_p": 1.01}, "min_p", "decimal_above_max_value"),
        ({"presence_penalty": -2.5}, "presence_penalty", "decimal_below_min_value"),
        ({"presence_penalty": 2.5}, "presence_penalty", "decimal_above_max_value"),
        ({"frequency_penalty": -3.0}, "frequency_penalty", "decimal_below_min_value"),
        ({"frequency_penalty": 3.0}, "frequency_penalty", "decimal_above_max_value"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "decimal_below_min_value"),
        ({"repetition_penalty": -1.0}, "repetition_penalty", "decimal_below_min_value"),
        ({"max_tokens": 0}, "max_tokens", "integer_below_min_value"),
        ({"max_tokens": -5}, "max_tokens", "integer_below_min_value"),
        ({"min_tokens": -1}, "min_tokens", "integer_below_min_value"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens", "integer_above_max_value"),
        ({"logprobs": 21}, "logprobs", "integer_above_max_value"),
        ({"logprobs": -1}, "logprobs", "integer_below_min_value"),
        ({"prompt_logprobs": 21}, "prompt_logprobs", "integer_above_max_value"),
        ({"stop": ("ok", "")}, "stop", "empty_string"),
        ({"stop_token_ids": (3, -1)}, "stop_token_ids", "invalid_value"),
        ({"logit_bias": {5: 101.0}}, "logit_bias", "decimal_above_max_value"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias", "invalid_value"),
    ],
)
def test_each_range_error(params: dict[str, Any], param: str, code: str) -> None:
    error = validate_request(request(params=params), CONFIG, MODEL)
    assert error is not None
    assert (error.status_code, error.type, error.param, error.code) == (
        400,
        "BadRequestError",
        param,
        code,
    )
    assert error.request_id == "r1"
    assert param in error.message


def test_range_error_message_names_the_limit() -> None:
    error = validate_request(request(params={"temperature": 3}), CONFIG, MODEL)
    assert error is not None
    assert error.message == (
        "Invalid 'temperature': decimal above maximum value. Expected a value <= 2, "
        "but got 3 instead."
    )


def test_max_n_and_max_logprobs_come_from_the_config() -> None:
    config = EngineConfig(max_logprobs=5, max_n=2)
    assert validate_request(request(params={"n": 2, "logprobs": 5}), config, MODEL) is None
    n_error = validate_request(request(params={"n": 3}), config, MODEL)
    lp_error = validate_request(request(params={"logprobs": 6}), config, MODEL)
    assert n_error is not None and n_error.param == "n"
    assert lp_error is not None and lp_error.param == "logprobs"


def test_unknown_model_is_404_with_vllm_wording() -> None:
    error = validate_request(request(model="gpt-9"), CONFIG, MODEL)
    assert error is not None
    assert error.status_code == 404
    assert error.type == "NotFoundError"
    assert error.message == "The model `gpt-9` does not exist."
    assert error.param == "model"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"prompt": "a", "prompt_token_ids": (1,)}, "prompt"),
        ({"prompt": "a", "messages": (ChatMessage("user", "x"),)}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt_token_ids": ()}, "prompt"),
        ({"prompt_token_ids": (1, -2)}, "prompt"),
        ({"messages": ()}, "messages"),
    ],
)
def test_prompt_shape_errors(kwargs: dict[str, Any], param: str) -> None:
    error = validate_request(request(**kwargs), CONFIG, MODEL)
    assert error is not None
    assert (error.status_code, error.param) == (400, param)


def test_token_ids_and_messages_are_valid_prompts() -> None:
    assert validate_request(request(prompt_token_ids=(0, 50256)), CONFIG, MODEL) is None
    chat = request(messages=(ChatMessage("system", "s"), ChatMessage("user", "u")))
    assert validate_request(chat, CONFIG, MODEL) is None


def test_model_is_checked_before_parameters() -> None:
    error = validate_request(request(model="x", params={"n": 0}), CONFIG, MODEL)
    assert error is not None and error.status_code == 404


# ---------------------------------------------------------------------------------------
# check_context_length


def test_context_fits_exactly() -> None:
    assert check_context_length("r", 100, 28, 128) == (28, None)


def test_max_tokens_none_resolves_to_the_rest_of_the_context() -> None:
    assert check_context_length("r", 100, None, 128) == (28, None)
    assert check_context_length("r", 127, None, 128) == (1, None)


def test_prompt_plus_max_tokens_too_long() -> None:
    resolved, error = check_context_length("r7", 100, 29, 128)
    assert resolved == 0 and error is not None
    assert (error.status_code, error.type, error.code) == (
        400,
        "BadRequestError",
        "context_length_exceeded",
    )
    assert error.request_id == "r7"
    assert error.message == (
        "This model's maximum context length is 128 tokens. However, you requested 29 output "
        "tokens and your prompt contains 100 input tokens, for a total of 129 tokens. Please "
        "reduce the length of the input prompt or the number of requested output tokens."
    )


def test_prompt_alone_too_long() -> None:
    _, error = check_context_length("r", 128, None, 128)
    assert error is not None and error.code == "context_length_exceeded"
    assert error.message == (
        "This model's maximum context length is 128 tokens. However, your request has 128 "
        "input tokens. Please reduce the length of the input messages."
    )
    _, error = check_context_length("r", 500, 16, 128)
    assert error is not None and "for a total of 516 tokens" in error.message
