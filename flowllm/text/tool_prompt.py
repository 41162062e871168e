"""Chat turns as template messages, tools included, for templates with or without tools.

A template that renders tools (transformers' `apply_chat_template(tools=...)`: Qwen2.5,
Hermes, Llama 3.1...) gets the OpenAI turns as they are: assistant turns with
`tool_calls` (arguments as objects, which is what such templates expect) and `tool`
turns with `tool_call_id`. A template that ignores `tools` (its prompt is the same with
and without them, e.g. SmolLM2's) gets the fallback instead, so tools work with any chat
model:

- the tool definitions go into the system prompt (`FALLBACK_TOOL_PROMPT`, Hermes' and
  Qwen2.5's wording, after the request's own system message if any);
- an assistant turn's calls become `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
  lines of its content;
- a `tool` turn becomes a user turn holding `<tool_response>...</tool_response>`.

That is the form the `hermes` tool-call parser reads back.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from flowllm.messages import ChatMessage, ToolCall

FALLBACK_TOOL_PROMPT = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n"
    "<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n'
    "</tool_call>"
)


def _arguments(text: str) -> Any:
    """A call's arguments as an object when they are JSON (templates expect that)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _call_dict(call: ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": _arguments(call.arguments)},
    }


def native_messages(messages: tuple[ChatMessage, ...]) -> list[dict[str, Any]]:
    """The turns as OpenAI-shaped dicts, for a template that renders tools itself."""
    out = []
    for m in messages:
        entry: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            entry["tool_calls"] = [_call_dict(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        out.append(entry)
    return out


def fallback_messages(
    messages: tuple[ChatMessage, ...], tools: tuple[dict[str, Any], ...] | None
) -> list[dict[str, Any]]:
    """The turns with tools, calls and results written as text (see the module doc)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "tool":
            out.append(
                {"role": "user", "content": f"<tool_response>\n{m.content}\n</tool_response>"}
            )
            continue
        content = m.content
        if m.tool_calls:
            calls = [
                "<tool_call>\n"
                + json.dumps(
                    {"name": c.name, "arguments": _arguments(c.arguments)}, ensure_ascii=False
                )
                + "\n</tool_call>"
                for c in m.tool_calls
            ]
            content = "\n".join([content, *calls] if content else calls)
        out.append({"role": m.role, "content": content})
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        prompt = FALLBACK_TOOL_PROMPT.format(tools=listing)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


PROBE_MESSAGES: tuple[dict[str, Any], ...] = ({"role": "user", "content": "x"},)
PROBE_TOOLS: tuple[dict[str, Any], ...] = (
    {
        "type": "function",
        "function": {
            "name": "flowllm_probe",
            "description": "probe",
            "parameters": {"type": "object", "properties": {}},
        },
    },
)


def renders_tools(render: Callable[[list[dict[str, Any]] | None], str]) -> bool:
    """Whether a template shows tools in the prompt: `render(tools)` renders the probe
    conversation; a template whose output does not change with tools ignores them."""
    try:
        return render(list(PROBE_TOOLS)) != render(None)
    except Exception:  # a template that fails on the probe is read as not knowing tools
        return False


def template_messages(
    messages: tuple[ChatMessage, ...],
    tools: tuple[dict[str, Any], ...] | None,
    template_renders_tools: Callable[[], bool],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to render the template with: native when it renders tools,
    else the fallback with no tools left for the template."""
    uses_tools = tools is not None or any(m.tool_calls or m.role == "tool" for m in messages)
    if not uses_tools:
        return [{"role": m.role, "content": m.content} for m in messages], None
    if template_renders_tools():
        return native_messages(messages), list(tools) if tools else None
    return fallback_messages(messages, tools), None
