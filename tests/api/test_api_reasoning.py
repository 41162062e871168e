"""`--reasoning-parser` through the openai SDK, over the fake engine: the thinking part
in `message.reasoning_content` and streamed `delta.reasoning_content`, tool calls and
structured outputs applying to the answer only.

The server's template is the last message's content, and the fake engine generates its
prompt back (`expected_tokens`, choice 0), so a test scripts the output exactly. The
GPT-2 tokenizer writes each tag as three tokens, and each token streams as its own delta:
every tag arrives split across deltas.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import openai
import pytest
from api_fake_engine import MODEL, FakeEngine, make_app
from litestar.testing import AsyncTestClient
from uvicorn_server import Server

from flowllm.messages import ReasoningTokens
from flowllm.text.reasoning import REASONING_PARSERS

OUTPUT_IS_THE_LAST_MESSAGE = "{{ messages[-1]['content'] }}"

# (parser, generated output, its thinking, its answer): split by hand.
OUTPUTS = [
    ("qwen3", "<think>Two and two make four.</think>\n\nIt is 4.", "Two and two make four.",
     "\n\nIt is 4."),
    ("qwen3", "It is 4.", None, "It is 4."),  # thinking off: all content
    ("deepseek_r1", "Two and two make four.</think>It is 4.", "Two and two make four.",
     "It is 4."),
    ("deepseek_r1", "<think>Two and two.</think>It is 4.", "Two and two.", "It is 4."),
    ("deepseek_r1", "Still thinking", "Still thinking", None),  # never closed
]  # fmt: skip
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def scripted(tokenizer: Any, output: str) -> dict[str, Any]:
    """Request arguments under which the fake engine generates exactly `output`."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": output}],
        "max_tokens": len(tokenizer.encode(output)),
    }


@pytest.fixture(scope="module")
def servers(tokenizer: Any) -> Iterator[dict[str, Server]]:
    """A server of each parser, with auto tool choice read by the hermes parser."""
    with ExitStack() as stack:
        yield {
            parser: stack.enter_context(
                Server(
                    FakeEngine(tokenizer),
                    chat_template=OUTPUT_IS_THE_LAST_MESSAGE,
                    reasoning_parser=parser,
                    tool_call_parser="hermes",
                )
            )
            for parser in REASONING_PARSERS
        }


def sdk(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_the_tags_are_split_across_tokens(tokenizer: Any) -> None:
    assert len(tokenizer.encode("<think>")) == len(tokenizer.encode("</think>")) == 3


@pytest.mark.parametrize(("parser", "output", "thinking", "answer"), OUTPUTS)
def test_reasoning_content_whole_and_streamed(
    servers: dict[str, Server],
    tokenizer: Any,
    parser: str,
    output: str,
    thinking: str | None,
    answer: str | None,
) -> None:
    client = sdk(servers[parser])
    args = scripted(tokenizer, output)
    whole = client.chat.completions.create(**args)
    message = whole.choices[0].message
    assert (message.model_extra or {})["reasoning_content"] == thinking
    assert message.content == answer
    assert whole.usage is not None  # every generated token counts, thinking included
    assert whole.usage.completion_tokens == args["max_tokens"]
    stream = client.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    )
    parts: dict[str, list[str]] = {"reasoning_content": [], "content": []}
    order = []
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta.model_dump(exclude_none=True)
            for field in parts:
                if delta.get(field):
                    parts[field].append(delta[field])
                    order.append(field)
    assert "".join(parts["reasoning_content"]) == (thinking or "")
    assert "".join(parts["content"]) == (answer or "")
    assert order == sorted(order, key=["reasoning_content", "content"].index)
    for piece in parts["reasoning_content"] + parts["content"]:
        assert "think>" not in piece and "</" not in piece and not piece.startswith("<")
    assert usage is not None and usage.completion_tokens == args["max_tokens"]


def test_a_server_without_a_parser_leaves_the_thinking_in_content(tokenizer: Any) -> None:
    output = "<think>Two and two.</think>It is 4."
    with Server(FakeEngine(tokenizer), chat_template=OUTPUT_IS_THE_LAST_MESSAGE) as running:
        message = sdk(running).chat.completions.create(**scripted(tokenizer, output))
    assert message.choices[0].message.content == output
    assert "reasoning_content" not in (message.choices[0].message.model_extra or {})


@pytest.mark.parametrize("parser", REASONING_PARSERS)
def test_tool_calls_are_read_from_the_answer(
    servers: dict[str, Server], tokenizer: Any, parser: str
) -> None:
    """A `<tool_call>` the model writes while thinking is thinking; the answer's call is
    the call."""
    thinking = "I could use <tool_call> here."
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    opening = "<think>" if parser == "qwen3" else ""
    output = f"{opening}{thinking}</think>{call}"
    args = {**scripted(tokenizer, output), "tools": [WEATHER], "tool_choice": "auto"}
    client = sdk(servers[parser])
    message = client.chat.completions.create(**args).choices[0]
    assert (message.message.model_extra or {})["reasoning_content"] == thinking
    assert message.message.content is None
    (tool_call,) = message.message.tool_calls or []
    assert tool_call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(tool_call.function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    streamed_thinking, arguments = "", ""
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            streamed_thinking += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            for piece in choice.delta.tool_calls or []:
                arguments += piece.function.arguments or ""  # type: ignore[union-attr]
    assert streamed_thinking == thinking
    assert json.loads(arguments) == {"city": "Paris"}


@pytest.fixture(scope="module")
def tag_tokenizer(tokenizer: Any) -> Any:
    """GPT-2's tokenizer with <think> and </think> as single tokens, as in Qwen3's."""
    copied = copy.deepcopy(tokenizer)
    copied.add_tokens(["<think>", "</think>"])
    return copied


@pytest.mark.anyio
@pytest.mark.parametrize("parser", REASONING_PARSERS)
async def test_constraints_start_after_the_thinking_part(tag_tokenizer: Any, parser: str) -> None:
    """Structured outputs and tool choices that constrain the output carry where the
    thinking part ends (the guide stage applies it: tests/sampling/test_grammar.py);
    completions are unaffected."""
    start, end = tag_tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    tags = ReasoningTokens(start=start, end=end, opens_inside=parser == "deepseek_r1")
    engine = FakeEngine(tag_tokenizer)
    messages = [{"role": "user", "content": "Weather?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    bodies = [
        {"response_format": {"type": "json_object"}},
        {"guided_regex": "[0-9]+"},
        {"tools": [WEATHER], "tool_choice": "required"},
        {"tools": [WEATHER], "tool_choice": named},
    ]
    async with AsyncTestClient(make_app(engine, reasoning_parser=parser)) as client:
        for body in bodies:
            r = await client.post(
                "/v1/chat/completions", json={"messages": messages, "max_tokens": 2, **body}
            )
            assert r.status_code == 200, r.text
            spec = engine.submitted[-1].params.structured_outputs
            assert spec is not None and spec.after_reasoning == tags
        r = await client.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 1, "guided_regex": "[0-9]"}
        )
        assert r.status_code == 200
        spec = engine.submitted[-1].params.structured_outputs
        assert spec is not None and spec.after_reasoning is None


@pytest.mark.anyio
async def test_constraints_are_refused_where_the_tags_are_not_tokens(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer)
    async with AsyncTestClient(make_app(engine, reasoning_parser="qwen3")) as client:
        r = await client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_object"},
            },
        )
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "response_format"
    assert "--reasoning-parser qwen3" in error["message"] and "single tokens" in error["message"]
    assert engine.submitted == []
