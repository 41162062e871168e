"""The offline API with constraints and tools, on the bundled SmolLM2."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from flowllm import LLM, SamplingParams, StructuredOutputs
from flowllm.mailbox import RequestFailed

ARGS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather in a city", "parameters": ARGS},
}


@pytest.fixture(scope="module")
def llm(smollm2_dir: Path) -> LLM:
    return LLM(str(smollm2_dir), served_model_name="smollm2-135m-instruct")


def test_generate_under_a_schema_and_a_regex(llm: LLM) -> None:
    outputs = llm.generate(
        ["The weather report as JSON:", "Product code:"],
        [
            SamplingParams(temperature=0.7, seed=2, max_tokens=60, n=2,
                           structured_outputs=StructuredOutputs(json=ARGS)),
            SamplingParams(temperature=0.0, max_tokens=20,
                           structured_outputs=StructuredOutputs(regex="[A-Z]{2}[0-9]{3}")),
        ],
    )  # fmt: skip
    for choice in outputs[0].outputs:
        jsonschema.validate(json.loads(choice.text), ARGS)
        assert choice.finish_reason == "stop"
    assert re.fullmatch("[A-Z]{2}[0-9]{3}", outputs[1].outputs[0].text)


def test_a_constraint_ends_its_output_even_with_ignore_eos(llm: LLM) -> None:
    """The grammar decides where a constrained output ends: complete, it allows only EOS,
    which ends the sequence whatever ignore_eos says (and no stage fails on it)."""
    choice = StructuredOutputs(choice=("yes", "no"))
    outputs = llm.generate(
        ["Yes or no?", "Tell me a story."],
        [
            SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                           structured_outputs=choice),
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        ],
    )  # fmt: skip
    constrained, free = outputs[0].outputs[0], outputs[1].outputs[0]
    assert constrained.text in ("yes", "no") and constrained.finish_reason == "stop"
    assert free.finish_reason == "length" and len(free.token_ids) == 8


def test_chat_with_tools_and_a_tool_turn(llm: LLM) -> None:
    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    forced = SamplingParams(temperature=0.0, max_tokens=40,
                            structured_outputs=StructuredOutputs(json=ARGS))  # fmt: skip
    (first,) = llm.chat(ask, forced, tools=[WEATHER])
    arguments = json.loads(first.outputs[0].text)
    jsonschema.validate(arguments, ARGS)
    prompt = llm.tokenizer.decode(first.prompt_token_ids)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt  # the fallback prompt
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}  # fmt: skip
    conversation = [
        *ask,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 celsius, snow"},
    ]
    (second,) = llm.chat(conversation, SamplingParams(temperature=0.0, max_tokens=30),
                         tools=[WEATHER])  # fmt: skip
    assert second.outputs[0].text
    prompt = llm.tokenizer.decode(second.prompt_token_ids)
    assert "<tool_response>\n-3 celsius, snow\n</tool_response>" in prompt
    assert '"arguments": ' + json.dumps(arguments) in prompt


def test_offline_errors_name_the_field(llm: LLM) -> None:
    bad = SamplingParams(structured_outputs=StructuredOutputs(regex="[a-", param="regex"))
    with pytest.raises(RequestFailed) as raised:
        llm.generate("x", bad)
    assert raised.value.error.param == "regex" and raised.value.error.kind == "invalid_request"
    with pytest.raises(RequestFailed) as raised:
        llm.chat([{"role": "user", "content": "x"}], tools=[{"type": "function"}])
    assert raised.value.error.param == "tools[0]"
