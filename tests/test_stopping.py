"""Stop rules for one sampled token: length limits, EOS, stop_token_ids, min_tokens."""

from __future__ import annotations

import itertools

import pytest

from flowllm.messages import SamplingParams, StructuredOutputs
from flowllm.stopping import StopRule, StopStrings, output_limit

EOS = (50256,)


@pytest.mark.parametrize(
    ("params", "token", "n_out", "total", "max_len", "want"),
    [
        # nothing to stop
        (SamplingParams(max_tokens=5), 11, 1, 10, 100, (None, None)),
        # max_tokens reached by this token
        (SamplingParams(max_tokens=5), 11, 5, 14, 100, ("length", None)),
        # context full: total length reaches max_model_len
        (SamplingParams(max_tokens=50), 11, 3, 100, 100, ("length", None)),
        (SamplingParams(max_tokens=50), 11, 3, 99, 100, (None, None)),
        # max_tokens None: only the context limits
        (SamplingParams(max_tokens=None), 11, 10_000, 10_009, None, (None, None)),
        (SamplingParams(max_tokens=None), 11, 91, 100, 100, ("length", None)),
        # EOS stops, with no stop_reason
        (SamplingParams(), 50256, 1, 10, 100, ("stop", None)),
        # ignore_eos: EOS is an ordinary token
        (SamplingParams(ignore_eos=True), 50256, 1, 10, 100, (None, None)),
        # a stop token id stops and is reported
        (SamplingParams(stop_token_ids=(13, 198)), 198, 2, 10, 100, ("stop", 198)),
        (SamplingParams(stop_token_ids=(13,), ignore_eos=True), 13, 2, 10, 100, ("stop", 13)),
        # EOS that is also a stop token id: EOS wins (no stop_reason)
        (SamplingParams(stop_token_ids=(50256,)), 50256, 2, 10, 100, ("stop", None)),
        # ignore_eos but EOS listed in stop_token_ids: it stops as a stop token
        (
            SamplingParams(stop_token_ids=(50256,), ignore_eos=True),
            50256,
            2,
            10,
            100,
            ("stop", 50256),
        ),
        # before min_tokens: neither EOS nor stop tokens stop ...
        (SamplingParams(min_tokens=3), 50256, 2, 10, 100, (None, None)),
        (SamplingParams(min_tokens=3, stop_token_ids=(13,)), 13, 2, 10, 100, (None, None)),
        # ... from min_tokens on they do
        (SamplingParams(min_tokens=3), 50256, 3, 10, 100, ("stop", None)),
        # ... but length limits apply before min_tokens too
        (SamplingParams(min_tokens=8, max_tokens=4), 50256, 4, 10, 100, ("length", None)),
        (SamplingParams(min_tokens=8, max_tokens=50), 11, 2, 100, 100, ("length", None)),
        # the model chose to stop on the last allowed token: "stop" wins over "length"
        (SamplingParams(max_tokens=4), 50256, 4, 10, 100, ("stop", None)),
        (SamplingParams(max_tokens=4, stop_token_ids=(13,)), 13, 4, 100, 100, ("stop", 13)),
    ],
)
def test_stop_rule(
    params: SamplingParams,
    token: int,
    n_out: int,
    total: int,
    max_len: int | None,
    want: tuple[str | None, int | None],
) -> None:
    """`total` is the prompt plus the `n_out` outputs, this token included."""
    assert StopRule(params, EOS, total - n_out, max_len)(token, n_out) == want


def test_several_eos_ids() -> None:
    rule = StopRule(SamplingParams(), frozenset({2, 32000}), 4, None)
    assert rule(32000, 1) == ("stop", None)
    assert rule(2, 1) == ("stop", None)
    assert rule(3, 1) == (None, None)


def test_output_limit() -> None:
    assert output_limit(SamplingParams(max_tokens=5), 10, 100) == 5
    assert output_limit(SamplingParams(max_tokens=50), 90, 100) == 10  # the context fills
    assert output_limit(SamplingParams(max_tokens=None), 90, 100) == 10
    assert output_limit(SamplingParams(max_tokens=None), 90, None) == float("inf")


def reference_rule(
    params: SamplingParams,
    token: int,
    eos: tuple[int, ...],
    n_out: int,
    total_len: int,
    max_len: int | None,
) -> tuple[str | None, int | None]:
    """The rules as the module docstring states them, one after the other."""
    length_hit = (params.max_tokens is not None and n_out >= params.max_tokens) or (
        max_len is not None and total_len >= max_len
    )
    if n_out >= params.min_tokens:
        eos_ends = not params.ignore_eos or params.structured_outputs is not None
        if eos_ends and token in eos:
            return "stop", None
        if token in params.stop_token_ids:
            return "stop", token
    if length_hit:
        return "length", None
    return None, None


def test_stop_rule_equals_the_stated_rules_everywhere() -> None:
    """The sampler's per-sequence form against the rules as stated, over a grid of cases."""
    eos = (50256, 2)
    tokens = (11, 13, 198, 2, 50256)
    for max_tokens in (None, 1, 4):
        for min_tokens in (0, 2, 5):
            for ignore_eos, constrained in itertools.product((False, True), repeat=2):
                for stop_ids in ((), (13,), (198, 50256)):
                    params = SamplingParams(
                        max_tokens=max_tokens,
                        min_tokens=min_tokens,
                        ignore_eos=ignore_eos,
                        stop_token_ids=stop_ids,
                        structured_outputs=StructuredOutputs(regex="a") if constrained else None,
                    )
                    for max_len in (None, 8, 12):
                        for prompt_len in (1, 6):
                            rule = StopRule(params, eos, prompt_len, max_len)
                            for n_out in range(1, 9):
                                for token in tokens:
                                    want = reference_rule(
                                        params, token, eos, n_out, prompt_len + n_out, max_len
                                    )
                                    assert rule(token, n_out) == want
                                    # the sampler's shortcut: outside it nothing ends
                                    quiet = n_out - 1 < rule.last_output
                                    if quiet and token not in rule.stopping_ids:
                                        assert want == (None, None)


def test_stop_strings_match_the_first_to_complete_and_hold_back_possible_starts() -> None:
    stops = StopStrings(("", "world", "lo w", "xyz"))
    assert stops.strings == ("world", "lo w", "xyz") and stops
    assert not StopStrings(("",))
    assert stops.first_match("hello world") == (3, "lo w")  # completes before "world"
    assert stops.first_match("hello") is None
    texts = ["hel", "hello ", "hello wor", "x", "xy", "abc", "", "wo"]
    for text in texts:  # against every proper prefix of every stop string
        want = max(
            (k for s in stops.strings for k in range(1, len(s)) if text.endswith(s[:k])),
            default=0,
        )
        assert stops.held_back(text) == want, text
