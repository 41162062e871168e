"""Tool calls: the request side (tool_choice, constraints), the prompt, and the parsers."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest
from jinja2 import Template

from flowllm.api.convert import prepare_chat, structured_outputs
from flowllm.api.errors import ApiError
from flowllm.api.protocol import ChatCompletionRequest, CompletionRequest
from flowllm.api.tool_calls import (
    HermesParser,
    Llama3JsonParser,
    NamedParser,
    ParsedOutput,
    RequiredParser,
    ToolCallParser,
)
from flowllm.messages import ChatMessage, StructuredOutputs, ToolCall
from flowllm.text.tool_prompt import renders_tools, template_messages

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def chat(**fields: Any) -> ChatCompletionRequest:
    return msgspec.convert({"messages": MESSAGES, **fields}, ChatCompletionRequest)


def prepare(req: ChatCompletionRequest, parser: str | None = "hermes") -> Any:
    prepared, _ = prepare_chat(
        req, request_id="c", served_model_name="m", arrival_time=0.0, chat_template=None,
        tool_parser=parser,
    )  # fmt: skip
    return prepared


def parse(parser: ToolCallParser, text: str, seed: int | None) -> ParsedOutput:
    """Feed `text` whole (seed None) or in random pieces of 1-6 characters."""
    out = ParsedOutput()
    rnd = random.Random(seed)
    at = 0
    while at < len(text):
        step = len(text) if seed is None else rnd.randint(1, 6)
        out.add(parser.feed(text[at : at + step]))
        at += step
    out.add(parser.finish())
    return out


HERMES = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"days": [1, {"x": "}]"}]}}\n</tool_call>\n<tool_call>\n{"arguments": {}, "name": '
    '"get_time"}\n</tool_call>'
)
CASES = [
    (
        HermesParser,
        HERMES,
        "Let me check. ",
        [("get_weather", '{"city": "Paris", "days": [1, {"x": "}]"}]}'), ("get_time", "{}")],
    ),
    (HermesParser, "No tools <tool_cal needed.", "No tools <tool_cal needed.", []),
    (
        Llama3JsonParser,
        '<|python_tag|>{"name": "a", "parameters": {"q": "x\\"y"}}; {"name": "b", "parameters": 7}',
        "",
        [("a", '{"q": "x\\"y"}'), ("b", "7")],
    ),
    (Llama3JsonParser, 'Just text {"name": 1}', 'Just text {"name": 1}', []),
    (
        RequiredParser,
        '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", '
        '"parameters": {}}]',
        "",
        [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")],
    ),
]


@pytest.mark.parametrize(("make", "text", "content", "calls"), CASES)
def test_parsers_read_the_same_calls_whole_and_streamed(
    make: Any, text: str, content: str, calls: list[tuple[str, str]]
) -> None:
    for seed in (None, 0, 1, 2, 3, 4, 5):
        parsed = parse(make(), text, seed)
        assert (parsed.content, parsed.calls) == (content, calls), seed
        for _, arguments in parsed.calls:
            json.loads(arguments)


def test_a_named_choice_is_the_whole_output() -> None:
    parsed = parse(NamedParser("get_weather"), '{"city": "Rome"}', 3)
    assert parsed.calls == [("get_weather", '{"city": "Rome"}')] and parsed.content == ""


def test_tool_choice_decides_mode_prompt_and_constraint() -> None:
    tools = [WEATHER, TIME]
    auto = prepare(chat(tools=tools))
    assert auto.tool_use.mode == "auto" and auto.request.params.structured_outputs is None
    assert [t["function"]["name"] for t in auto.request.tools] == ["get_weather", "get_time"]
    none = prepare(chat(tools=tools, tool_choice="none"))
    assert none.tool_use.mode == "none" and none.tool_use.parser_for() is None
    assert none.request.tools == auto.request.tools
    required = prepare(chat(tools=tools, tool_choice="required", parallel_tool_calls=False))
    schema = required.request.params.structured_outputs.json
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]] == [
        ["get_weather"], ["get_time"]
    ]  # fmt: skip
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {
        "type": "object", "properties": {}
    }  # fmt: skip
    named = prepare(
        chat(tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    )
    assert named.request.params.structured_outputs == StructuredOutputs(
        json=WEATHER["function"]["parameters"], param="tools[0]"
    )


@pytest.mark.parametrize(
    ("fields", "parser", "param"),
    [
        ({"tools": [WEATHER]}, None, "tool_choice"),  # auto without --enable-auto-tool-choice
        ({"tool_choice": "required"}, "hermes", "tool_choice"),  # no tools
        ({"parallel_tool_calls": True}, "hermes", "parallel_tool_calls"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "hermes",
            "tool_choice.function.name",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "hermes",
            "response_format",
        ),
        (
            {"messages": [{"role": "tool", "content": "18C"}]},
            "hermes",
            "messages[0].tool_call_id",
        ),
    ],
)
def test_tool_requests_that_cannot_be_served_name_their_field(
    fields: dict[str, Any], parser: str | None, param: str
) -> None:
    with pytest.raises(ApiError) as raised:
        prepare(chat(**fields), parser)
    assert raised.value.param == param


def test_each_constraint_field_names_itself() -> None:
    def of(**fields: Any) -> StructuredOutputs | None:
        return structured_outputs(msgspec.convert({"prompt": "x", **fields}, CompletionRequest))

    schema = {"type": "object"}
    assert of(response_format={"type": "json_object"}) == StructuredOutputs(
        json_object=True, param="response_format"
    )
    assert of(
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    ) == StructuredOutputs(json=schema, param="response_format.json_schema.schema")
    assert of(guided_choice=["a", "b"]) == StructuredOutputs(
        choice=("a", "b"), param="guided_choice"
    )
    assert of(structured_outputs={"regex": "x+"}) == StructuredOutputs(regex="x+")
    assert of(response_format={"type": "text"}) is None
    for fields, param in (
        ({"guided_json": schema, "guided_regex": "a"}, "guided_regex"),
        ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ):
        with pytest.raises(ApiError) as raised:
            of(**fields)
        assert raised.value.param == param


TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments.city }}]"
    "{% endfor %}{% if m.tool_call_id %}[for {{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
)
TURNS = (
    ChatMessage("user", "Weather in Paris?"),
    ChatMessage(
        "assistant", "", (ToolCall(id="c1", name="get_weather", arguments='{"city": "Paris"}'),)
    ),
    ChatMessage("tool", "18C", tool_call_id="c1"),
)


def render(template: str, messages: list[dict[str, Any]], tools: Any) -> str:
    return Template(template).render(messages=messages, tools=tools)


def test_a_template_that_renders_tools_gets_the_turns_as_they_are() -> None:
    assert renders_tools(
        lambda tools: render(TOOLS_TEMPLATE, [{"role": "user", "content": "x"}], tools)
    )
    messages, tools = template_messages(TURNS, (WEATHER,), lambda: True)
    text = render(TOOLS_TEMPLATE, messages, tools)
    assert text == (
        "TOOLS:get_weather;\n<user>Weather in Paris?\n<assistant>[call get_weather Paris]\n"
        "<tool>18C[for c1]\n"
    )


def test_the_fallback_puts_tools_in_the_system_prompt(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    template = tokenizer.chat_template

    def smol(messages: list[dict[str, Any]], tools: Any) -> str:
        return str(tokenizer.apply_chat_template(
            messages, chat_template=template, tools=tools, tokenize=False,
            add_generation_prompt=True,
        ))  # fmt: skip

    assert not renders_tools(lambda tools: smol([{"role": "user", "content": "x"}], tools))
    messages, tools = template_messages(TURNS, (WEATHER,), lambda: False)
    assert tools is None
    text = smol(messages, None)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in system
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert "<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>" in text
