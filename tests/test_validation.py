"""validate_request and check_context_length: every range, its status, type, param, code."""

from __future__ import annotations

import math
from typing import Any

import pytest

from flowllm.config import engine_config
from flowllm.messages import ChatMessage, GenerateRequest, SamplingParams
from flowllm.validation import (
    check_admission,
    check_context_length,
    show_number,
    validate_request,
)

MODEL = "m"
CONFIG = engine_config(max_logprobs=20, max_n=16)


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
    assert (error.kind, error.param, error.code) == (
        "invalid_request",
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
    config = engine_config(max_logprobs=5, max_n=2)
    assert validate_request(request(params={"n": 2, "logprobs": 5}), config, MODEL) is None
    n_error = validate_request(request(params={"n": 3}), config, MODEL)
    lp_error = validate_request(request(params={"logprobs": 6}), config, MODEL)
    assert n_error is not None and n_error.param == "n"
    assert lp_error is not None and lp_error.param == "logprobs"


def test_unknown_model_is_404_with_vllm_wording() -> None:
    error = validate_request(request(model="gpt-9"), CONFIG, MODEL)
    assert error is not None
    assert error.kind == "not_found"
    assert error.message == "The model `gpt-9` does not exist."
    assert error.param == "model"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"prompt": "a", "prompt_token_ids": (1,)}, "prompt"),
        ({"prompt": "a", "messages": (ChatMessage("user", "x"),)}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt_token_ids": (1, -2)}, "prompt"),
        ({"messages": ()}, "messages"),
    ],
)
def test_prompt_shape_errors(kwargs: dict[str, Any], param: str) -> None:
    error = validate_request(request(**kwargs), CONFIG, MODEL)
    assert error is not None
    assert (error.kind, error.param) == ("invalid_request", param)


def test_token_ids_and_messages_are_valid_prompts() -> None:
    assert validate_request(request(prompt_token_ids=(0, 50256)), CONFIG, MODEL) is None
    chat = request(messages=(ChatMessage("system", "s"), ChatMessage("user", "u")))
    assert validate_request(chat, CONFIG, MODEL) is None


def test_model_is_checked_before_parameters() -> None:
    error = validate_request(request(model="x", params={"n": 0}), CONFIG, MODEL)
    assert error is not None and error.kind == "not_found"


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
    assert (error.kind, error.code) == (
        "invalid_request",
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


# ---------------------------------------------------------------------------------------
# Request limits: every bound compared as integers, named by its param, messages short.

HUGE = 10**400
VOCAB = 1000


def invalid(params: dict[str, Any], config: Any = CONFIG, **kwargs: Any) -> Any:
    error = validate_request(request(params=params, **kwargs), config, MODEL, VOCAB)
    assert error is not None, params
    assert error.kind == "invalid_request"
    assert len(error.message) < 300, error.message  # a 400-digit number is not echoed
    return error


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"n": HUGE}, "n"),
        ({"n": -HUGE}, "n"),
        ({"max_tokens": -HUGE}, "max_tokens"),
        ({"min_tokens": -HUGE}, "min_tokens"),
        ({"max_tokens": 5, "min_tokens": HUGE}, "min_tokens"),
        ({"logprobs": HUGE}, "logprobs"),
        ({"logprobs": -HUGE}, "logprobs"),
        ({"prompt_logprobs": HUGE}, "prompt_logprobs"),
        ({"top_k": -HUGE}, "top_k"),
        ({"temperature": HUGE}, "temperature"),
        ({"stop_token_ids": (2**63,)}, "stop_token_ids"),
        ({"stop_token_ids": (HUGE,)}, "stop_token_ids"),
        ({"stop_token_ids": (-HUGE,)}, "stop_token_ids"),
        ({"logit_bias": {2**63: 1.0}}, "logit_bias"),
        ({"logit_bias": {HUGE: 1.0}}, "logit_bias"),
    ],
)
def test_huge_integers_are_400s_naming_the_param(params: dict[str, Any], param: str) -> None:
    assert invalid(params).param == param


def test_a_huge_integer_is_shown_abridged() -> None:
    error = invalid({"n": -HUGE})
    assert "(401 digits)" in error.message and "-10000000..." in error.message
    assert show_number(-(10**50_000)).startswith("-an integer of")  # str() itself is slow


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": math.nan}, "top_p"),
        ({"min_p": math.nan}, "min_p"),
        ({"presence_penalty": -math.inf}, "presence_penalty"),
        ({"frequency_penalty": math.nan}, "frequency_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"repetition_penalty": math.nan}, "repetition_penalty"),
        ({"logit_bias": {3: math.nan}}, "logit_bias"),
    ],
)
def test_non_finite_floats_are_rejected(params: dict[str, Any], param: str) -> None:
    error = invalid(params)
    assert (error.param, error.code) == (param, "invalid_value")


def test_repetition_penalty_is_bounded_above() -> None:
    assert validate_request(request(params={"repetition_penalty": 2.0}), CONFIG, MODEL) is None
    error = invalid({"repetition_penalty": 2.5})
    assert (error.param, error.code) == ("repetition_penalty", "decimal_above_max_value")


def test_token_ids_must_be_below_the_vocabulary_size() -> None:
    ok = {"stop_token_ids": (VOCAB - 1,), "logit_bias": {VOCAB - 1: 1.0}}
    assert validate_request(request(params=ok), CONFIG, MODEL, VOCAB) is None
    assert invalid({"stop_token_ids": (1, VOCAB)}).param == "stop_token_ids"
    assert invalid({"logit_bias": {VOCAB: 1.0}}).param == "logit_bias"
    error = invalid({}, prompt_token_ids=(1, VOCAB))
    assert error.param == "prompt" and str(VOCAB) in error.message
    assert invalid({}, prompt_token_ids=(-1,)).param == "prompt"


def test_stop_strings_are_bounded_in_number_and_length() -> None:
    limits = engine_config(max_stop_strings=2, max_stop_string_length=5)
    ok = {"stop": ("abcde", "x")}
    assert validate_request(request(params=ok), limits, MODEL) is None
    error = invalid({"stop": ("a", "b", "c")}, limits)
    assert (error.param, error.code) == ("stop", "array_above_max_length")
    error = invalid({"stop": ("a" * 6,)}, limits)
    assert (error.param, error.code) == ("stop", "string_above_max_length")
    big = invalid({"stop": ("a" * 40_000,)})  # the defaults
    assert big.param == "stop"


def test_stop_token_ids_and_logit_bias_entries_are_bounded() -> None:
    config = engine_config(max_stop_token_ids=2, max_logit_bias=3)
    ok = {"stop_token_ids": (1, 2), "logit_bias": {1: 1.0, 2: 1.0, 3: 1.0}}
    assert validate_request(request(params=ok), config, MODEL) is None
    assert invalid({"stop_token_ids": (1, 2, 3)}, config).param == "stop_token_ids"
    error = invalid({"logit_bias": {i: 1.0 for i in range(4)}}, config)
    assert (error.param, error.code) == ("logit_bias", "array_above_max_length")


def generate_requests(count: int, **params: Any) -> list[GenerateRequest]:
    return [
        GenerateRequest(
            request_id=f"r-{i}",
            model=MODEL,
            params=SamplingParams(**params),
            arrival_time=0.0,
            prompt="hi",
        )
        for i in range(count)
    ]


def admission(requests: list[GenerateRequest], config: Any = CONFIG, **kwargs: Any) -> Any:
    options = {"max_choices": 1024, "max_prompts": 256, **kwargs}
    return check_admission(requests, config.limits, 512, **options)


def test_admission_accepts_what_fits() -> None:
    assert admission(generate_requests(256)) is None
    assert admission(generate_requests(1, n=16, max_tokens=None)) is None


@pytest.mark.parametrize("n", [0, -HUGE, HUGE, 17, 30_000_000])
def test_admission_checks_n_first(n: int) -> None:
    error = admission(generate_requests(2, n=n))
    assert (error.kind, error.param) == ("invalid_request", "n")
    assert len(error.message) < 300


def test_admission_bounds_the_prompts_by_the_flag_and_the_channel() -> None:
    error = admission(generate_requests(300))
    assert (error.param, error.code) == ("prompt", "array_above_max_length")
    assert admission(generate_requests(11), max_prompts=10).param == "prompt"
    config = engine_config(max_prompts_per_request=4)
    assert admission(generate_requests(5), config).param == "prompt"


def test_admission_bounds_the_token_budget() -> None:
    config = engine_config(max_request_tokens=1000)
    assert admission(generate_requests(2, n=2, max_tokens=250), config) is None
    error = admission(generate_requests(2, n=2, max_tokens=251), config)
    assert (error.param, error.code) == ("max_tokens", "integer_above_max_value")
    # max_tokens unset counts as the context length (512 here)
    assert admission(generate_requests(2, max_tokens=None), config) is not None
    assert admission(generate_requests(1, max_tokens=HUGE)).param == "max_tokens"


def test_admission_refuses_more_choices_than_ever_admitted() -> None:
    assert admission(generate_requests(1, n=8), max_choices=4).param == "n"
    assert admission(generate_requests(3, n=2), max_choices=4).param == "prompt"
    assert admission(generate_requests(2, n=2), max_choices=4) is None
