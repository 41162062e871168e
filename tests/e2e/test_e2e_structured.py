"""Structured outputs and tool calling on the bundled SmolLM2, through the openai SDK.

`FLOWLLM_STRUCTURED_PROMPTS` sets how many prompts run under the nested JSON schema at
each temperature (default 20, the full check; all of them run as one batch).
"""

from __future__ import annotations

import ast
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_process import ServerProcess

from flowllm.messages import ChatMessage, ToolCall
from flowllm.text.tool_prompt import fallback_messages

MODEL = "smollm2-135m-instruct"
NUM_PROMPTS = int(os.environ.get("FLOWLLM_STRUCTURED_PROMPTS", "20"))
# A request waits for its whole batch of NUM_PROMPTS, whose steps the torch paths
# (FLOWLLM_NATIVE_KERNELS=0) run several times slower than the native kernels: past the
# shared clients' 60 s on two cores. The timeout only guards against a hang.
BATCH_TIMEOUT = 300.0

# Nested objects, enums, arrays and required fields; strings and numbers are bounded so
# that a 135M model cannot ramble past max_tokens.
PROFILE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def client(structured_server: ServerProcess) -> openai.OpenAI:
    return structured_server.client(timeout=BATCH_TIMEOUT)


def profile(client: openai.OpenAI, i: int, temperature: float, stream: bool = False) -> str:
    fields: dict[str, Any] = dict(
        model=MODEL,
        messages=[{"role": "user", "content": f"Create a profile for user number {i} as JSON."}],
        temperature=temperature,
        seed=i,
        max_tokens=160,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "profile", "schema": PROFILE, "strict": True},
        },
    )
    if not stream:
        answer = client.chat.completions.create(**fields)
        assert answer.choices[0].finish_reason == "stop"
        return answer.choices[0].message.content or ""
    text = ""
    for chunk in client.chat.completions.create(**fields, stream=True):
        text += chunk.choices[0].delta.content or "" if chunk.choices else ""
    return text


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_nested_json_schema_outputs_validate(client: openai.OpenAI, temperature: float) -> None:
    with ThreadPoolExecutor(NUM_PROMPTS) as pool:
        texts = list(pool.map(lambda i: profile(client, i, temperature), range(NUM_PROMPTS)))
    for text in texts:
        jsonschema.validate(json.loads(text), PROFILE)


def test_streamed_output_equals_the_whole(client: openai.OpenAI) -> None:
    for temperature in (0.0, 0.7):  # seeded: the same tokens either way
        assert profile(client, 3, temperature, stream=True) == profile(client, 3, temperature)


def complete(client: openai.OpenAI, prompt: str, temperature: float, **extra: Any) -> str:
    answer = client.completions.create(
        model=MODEL, prompt=prompt, temperature=temperature, seed=1, max_tokens=60, extra_body=extra
    )
    assert answer.choices[0].finish_reason == "stop", answer
    return answer.choices[0].text


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_regex_choice_and_gbnf_outputs_match(client: openai.OpenAI, temperature: float) -> None:
    for prompt in ("The product code is", "Serial number:"):
        code = complete(client, prompt, temperature, guided_regex="[A-Z]{3}-[0-9]{4}")
        assert re.fullmatch("[A-Z]{3}-[0-9]{4}", code), code
    colours = ["red", "green", "blue"]
    for prompt in ("The sky is", "Grass is"):
        picked = complete(client, prompt, temperature, structured_outputs={"choice": colours})
        assert picked in colours
    arithmetic = (
        'root ::= expr\nexpr ::= term (("+" | "-") term){0,3}\n'
        'term ::= factor (("*" | "/") factor){0,2}\nfactor ::= num | "(" expr ")"\n'
        "num ::= [1-9] [0-9]{0,2}"
    )
    for prompt in ("2 + 2 * 3 =", "A sum:"):
        expr = complete(client, prompt, temperature, guided_grammar=arithmetic)
        tree = ast.parse(expr, mode="eval")  # parses as arithmetic, and nothing else
        allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)
        assert all(isinstance(node, allowed) for node in ast.walk(tree)), expr


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population: int = Field(ge=0, le=100_000_000)


def test_sdk_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    answer = client.beta.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        temperature=0,
        max_tokens=80,
    )
    city = answer.choices[0].message.parsed
    assert isinstance(city, City) and city.name


def call(client: openai.OpenAI, **fields: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=120, **fields
    )


def check_calls(
    choice: Any, names: set[str] | None = None, finishes: tuple[str, ...] = ("tool_calls",)
) -> list[Any]:
    assert choice.finish_reason in finishes
    calls = choice.message.tool_calls
    assert calls and choice.message.content is None
    for c in calls:
        assert c.type == "function" and re.fullmatch("call_[0-9a-f]{24}", c.id)
        assert names is None or c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    assert len({c.id for c in calls}) == len(calls)
    return calls  # type: ignore[no-any-return]


def test_tool_choice_required_and_named(client: openai.OpenAI) -> None:
    # With parallel calls allowed the model may repeat its call until max_tokens (which it
    # does hinges on the last bits of its logits: the AVX2 and AVX-512 builds differ);
    # every call it made is whole either way.
    check_calls(call(client, tool_choice="required").choices[0], finishes=("tool_calls", "length"))
    single = check_calls(call(client, tool_choice="required", parallel_tool_calls=False).choices[0])
    assert len(single) == 1
    named = {"type": "function", "function": {"name": "get_time"}}
    (only,) = check_calls(call(client, tool_choice=named).choices[0], {"get_time"})
    assert "paris" in json.loads(only.function.arguments)["city"].lower()


def assembled(stream: Any) -> tuple[list[tuple[str, str]], str | None]:
    """The calls a stream's deltas build (name, arguments), and its finish_reason."""
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for piece in choice.delta.tool_calls or ():
                if piece.index not in calls:
                    assert piece.id and piece.type == "function" and piece.function.name
                    calls[piece.index] = [piece.function.name, ""]
                else:
                    assert piece.id is None and piece.function.name is None
                calls[piece.index][1] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return [(name, args) for name, args in (calls[i] for i in sorted(calls))], finish


@pytest.mark.parametrize(
    "fields",
    [
        {"tool_choice": "required", "parallel_tool_calls": False},
        {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        # auto, read by the hermes parser; the output is pinned so that it calls a tool
        {"extra_body": {"structured_outputs": {"choice": [
            'I will check. <tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "unit": "celsius"}}\n</tool_call>'
        ]}}},
    ],
)  # fmt: skip
def test_streamed_tool_call_deltas_assemble_to_the_whole(
    client: openai.OpenAI, fields: dict[str, Any]
) -> None:
    whole = call(client, **fields).choices[0]
    calls = check_calls(whole) if "tool_choice" in fields else whole.message.tool_calls
    if "tool_choice" not in fields:  # auto: the text before the call is content
        assert whole.message.content == "I will check. " and whole.finish_reason == "tool_calls"
    streamed, finish = assembled(call(client, stream=True, **fields))
    assert streamed == [(c.function.name, c.function.arguments) for c in calls]
    assert finish == "tool_calls"


def test_a_two_turn_tool_conversation(client: openai.OpenAI, smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    named = {"type": "function", "function": {"name": "get_weather"}}
    first = call(client, tool_choice=named).choices[0]
    (made,) = check_calls(first, {"get_weather"})
    result = json.dumps({"temperature": 18, "unit": "celsius", "sky": "sunny"})
    messages: list[Any] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [made.model_dump()]},
        {"role": "tool", "tool_call_id": made.id, "content": result},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", temperature=0,
        max_tokens=60,
    )  # fmt: skip
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.content
    assert not answer.message.tool_calls
    # SmolLM2's template ignores tools, so the tools, the call and its result are in the
    # prompt as the fallback writes them
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    turns = (
        ChatMessage("user", ASK[0]["content"]),
        ChatMessage("assistant", "", (ToolCall(id=made.id, name=made.function.name,
                                              arguments=made.function.arguments),)),
        ChatMessage("tool", result, tool_call_id=made.id),
    )  # fmt: skip
    text = tokenizer.apply_chat_template(
        fallback_messages(turns, tuple(TOOLS)), tokenize=False, add_generation_prompt=True
    )
    assert "<tool_response>\n" + result in text
    assert second.usage is not None
    assert second.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format.json_schema.schema",
        ),
        ({"extra_body": {"structured_outputs": {"grammar": "root ::= undefined_rule"}}},
         "structured_outputs"),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
        ({"extra_body": {"guided_choice": []}}, "guided_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}],
          "tool_choice": "none"}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
          "tool_choice": "required"}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
          "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools[0]"),
    ],
)  # fmt: skip
def test_invalid_constraints_and_tools_are_a_400_naming_the_field(
    client: openai.OpenAI, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **fields)
    assert raised.value.status_code == 400
    body = raised.value.body
    assert isinstance(body, dict) and body["param"] == param, body
