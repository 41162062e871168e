"""Tool calls in chat output: the constraint a tool_choice needs, and the parsers.

`tool_choice` decides how the output is read:

- `none` (or no tools): the output is content (tools are still shown to the model, as
  vLLM does).
- `auto`: the model chooses; its output is read by the parser `--tool-call-parser` names
  (only with `--enable-auto-tool-choice`): `hermes` takes `<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>` blocks (Qwen2.5, Hermes, SmolLM and the fallback
  prompt of flowllm.text.tool_prompt), `llama3_json` an output that is one or more
  `{"name": ..., "parameters": {...}}` objects separated by `;`.
- `required`: a grammar makes the output a JSON array of `{"name", "parameters"}` calls
  (one at most when `parallel_tool_calls` is false), each valid for its function.
- a named function: a grammar makes the output that function's arguments.

Every parser is incremental: it is fed the output's text piece by piece and returns
`ContentDelta`, `CallStart` and `ArgumentsDelta` events, so a stream sends OpenAI's
`delta.tool_calls` (the name first, then the arguments as they are generated) and a
whole response is the same events assembled: both always agree. `arguments` is the
model's JSON text of the arguments, as generated.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import msgspec

from flowllm.api.errors import ApiError
from flowllm.api.protocol import ChatCompletionRequest, ToolParam
from flowllm.messages import StructuredOutputs
from flowllm.text.tags import partial_suffix


class ContentDelta(msgspec.Struct, frozen=True):
    text: str


class CallStart(msgspec.Struct, frozen=True):
    index: int
    name: str


class ArgumentsDelta(msgspec.Struct, frozen=True):
    index: int
    text: str


Event = ContentDelta | CallStart | ArgumentsDelta


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ---------------------------------------------------------------------------------------
# Request side


class ToolUse(msgspec.Struct, frozen=True, kw_only=True):
    """How one chat request uses its tools."""

    mode: str  # none | auto | required | named
    tools: tuple[dict[str, Any], ...] | None  # to render in the prompt (None: none)
    constraint: StructuredOutputs | None  # required and named: the output's grammar
    function: str | None = None  # named: the function
    parser: str | None = None  # auto: the parser's name

    def parser_for(self) -> ToolCallParser | None:
        """A fresh parser for one choice's output, or None when the output is content."""
        if self.mode == "auto" and self.parser is not None:
            return HermesParser() if self.parser == "hermes" else Llama3JsonParser()
        if self.mode == "required":
            return RequiredParser()
        if self.mode == "named" and self.function is not None:
            return NamedParser(self.function)
        return None


def tool_use(req: ChatCompletionRequest, tool_parser: str | None) -> ToolUse:
    """The request's tool mode; a 400 for a choice its tools or the server cannot serve.

    `tool_parser`: the server's `--tool-call-parser` when `--enable-auto-tool-choice` is
    on, else None (then `auto` with tools is refused, as vLLM does).
    """
    tools = [tool_dict(t) for t in req.tools or ()]
    choice = req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise ApiError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
        if req.parallel_tool_calls is not None:
            raise ApiError(
                "When using `parallel_tool_calls`, `tools` must be set.",
                param="parallel_tool_calls",
            )
        return ToolUse(mode="none", tools=None, constraint=None)
    rendered = tuple(tools)
    if choice == "none":  # shown to the model, as vLLM does; the output is content
        return ToolUse(mode="none", tools=rendered, constraint=None)
    if choice is None or choice == "auto":
        if tool_parser is None:
            raise ApiError(
                '"auto" tool choice requires --enable-auto-tool-choice and '
                "--tool-call-parser to be set",
                param="tool_choice",
            )
        return ToolUse(mode="auto", tools=rendered, constraint=None, parser=tool_parser)
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    if choice == "required":
        schema = required_schema(list(by_name.values()), req.parallel_tool_calls is not False)
        return ToolUse(
            mode="required",
            tools=rendered,
            constraint=StructuredOutputs(json=schema, param="tools"),
        )
    assert not isinstance(choice, str)
    if choice.type != "function":
        raise ApiError(
            f"Invalid 'tool_choice.type': expected 'function', got {choice.type!r}.",
            param="tool_choice.type",
        )
    name = choice.function.name
    if name not in by_name:
        raise ApiError(
            f"Invalid 'tool_choice': the function {name!r} is not among the tools.",
            param="tool_choice.function.name",
        )
    return ToolUse(
        mode="named",
        tools=rendered,
        constraint=StructuredOutputs(
            json=parameters_schema(by_name[name]), param=f"tools[{list(by_name).index(name)}]"
        ),
        function=name,
    )


def tool_dict(tool: ToolParam) -> dict[str, Any]:
    """A tool as the template sees it: the fields the client gave (no nulls)."""
    function = {k: v for k, v in msgspec.to_builtins(tool.function).items() if v is not None}
    return {"type": tool.type, "function": function}


def parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters schema (no parameters: an object)."""
    parameters = function.get("parameters")
    return parameters if parameters else {"type": "object", "properties": {}}


def required_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of `tool_choice: required`'s output: an array of calls."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [f["name"]]},
                "parameters": parameters_schema(f),
            },
            "required": ["name", "parameters"],
        }
        for f in functions
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


# ---------------------------------------------------------------------------------------
# Output side


class _CallScanner:
    """Reads JSON call objects `{"name": ..., ARGS: value}` as their text arrives.

    `call_depth`: the nesting at which call objects open (0: one after another, as in
    llama3_json or hermes blocks; 1: inside an array). Text outside call objects is
    skipped. Emits the name when it is complete and the arguments value's text as it
    grows (a value given before the name is held until the name; a number or literal
    is emitted whole).
    """

    def __init__(self, arg_keys: tuple[str, ...], call_depth: int = 0) -> None:
        self.arg_keys = arg_keys
        self.call_depth = call_depth
        self.num_calls = 0
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._open_call()

    def _open_call(self) -> None:
        self._buf: list[str] = []  # the current call object's text
        self._string_start = 0
        self._expect_key = True
        self._key: str | None = None
        self._name: str | None = None
        self._args_start = -1  # index in _buf where the arguments value began
        self._args_end: int | None = None  # and where it ended, once it has
        self._args_sent = 0  # characters of the arguments value already emitted

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        inner = self.call_depth + 1  # depth inside a call object
        buf = self._buf
        for ch in text:
            depth = self._depth
            if depth < inner and not (depth == self.call_depth and ch == "{"):
                # outside any call object: only the nesting matters (the array of calls)
                self._depth += (ch in "{[") - (ch in "}]" and depth > 0)
                continue
            if depth == self.call_depth:  # a call object opens
                self._open_call()
                buf = self._buf
            buf.append(ch)
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                    if depth == inner:
                        self._string_done(events)
                continue
            if ch == '"':
                self._in_string = True
                self._string_start = len(buf) - 1
                if depth == inner and not self._expect_key:
                    self._value_begins()
            elif ch in "{[":
                if depth == inner and not self._expect_key:
                    self._value_begins()
                self._depth += 1
            elif ch in "}]":
                self._depth = depth - 1
                if depth == inner:  # the call object closes
                    self._value_ends(len(buf) - 1)
                    self._close_call(events)
                    continue
                if depth == inner + 1:  # a structured value of the call closes
                    self._value_ends(len(buf))
            elif depth == inner:
                if ch == ":":
                    self._expect_key = False
                elif ch == ",":
                    self._value_ends(len(buf) - 1)
                    self._expect_key = True
                elif not ch.isspace() and not self._expect_key:
                    self._value_begins()
        self._emit_args(events)
        return events

    def _value_begins(self) -> None:
        if self._key in self.arg_keys and self._args_start < 0:
            self._args_start = len(self._buf) - 1

    def _value_ends(self, end: int) -> None:
        """The value at the call's depth ends before `end` (if it is the arguments)."""
        if self._args_start >= 0 and self._args_end is None:
            self._args_end = end

    def _string_done(self, events: list[Event]) -> None:
        text = "".join(self._buf[self._string_start :])
        if self._expect_key:
            self._key = json.loads(text)
        elif self._key == "name" and self._name is None:
            self._name = json.loads(text)
            events.append(CallStart(self.num_calls, str(self._name)))
            self._emit_args(events)
        else:
            self._value_ends(len(self._buf))

    def _emit_args(self, events: list[Event]) -> None:
        if self._name is None or self._args_start < 0:
            return
        value = "".join(self._buf[self._args_start : self._args_end]).rstrip()
        if self._args_end is None and not value.startswith(("{", "[", '"')):
            return  # a number or literal: only whole
        if len(value) > self._args_sent:
            events.append(ArgumentsDelta(self.num_calls, value[self._args_sent :]))
            self._args_sent = len(value)

    def _close_call(self, events: list[Event]) -> None:
        if self._name is not None:  # without a name it was no call
            self._emit_args(events)
            self.num_calls += 1
        self._open_call()


class ToolCallParser:
    """Turns one choice's output text, fed in pieces, into content and tool-call events."""

    def feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        """The output ended: whatever was held back."""
        return []


class HermesParser(ToolCallParser):
    """`<tool_call>{...}</tool_call>` blocks; text before the first block is content."""

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def __init__(self) -> None:
        self._scanner = _CallScanner(("arguments", "parameters"))
        self._held = ""  # text that may be the start of a tag
        self._inside = False
        self._seen_call = False

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        self._held += text
        while self._held:
            tag = self.CLOSE if self._inside else self.OPEN
            at = self._held.find(tag)
            if at < 0:
                keep = partial_suffix(self._held, tag)
                self._out(self._held[: len(self._held) - keep], events)
                self._held = self._held[len(self._held) - keep :]
                break
            self._out(self._held[:at], events)
            self._held = self._held[at + len(tag) :]
            self._inside = not self._inside
            self._seen_call = True
        return events

    def _out(self, text: str, events: list[Event]) -> None:
        if not text:
            return
        if self._inside:
            events.extend(self._scanner.feed(text))
        elif not self._seen_call:
            events.append(ContentDelta(text))

    def finish(self) -> list[Event]:
        events: list[Event] = []
        held, self._held = self._held, ""
        self._out(held, events)
        return events


class Llama3JsonParser(ToolCallParser):
    """An output that starts with `{` (after whitespace or `<|python_tag|>`) is calls
    `{"name": ..., "parameters": {...}}` separated by `;`; any other output is content."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self._scanner = _CallScanner(("parameters", "arguments"))
        self._mode: str | None = None  # None: undecided, "calls" or "content"
        self._held = ""

    def feed(self, text: str) -> list[Event]:
        if self._mode == "calls":
            return self._scanner.feed(text)
        if self._mode == "content":
            return [ContentDelta(text)]
        self._held += text
        head = self._held.lstrip()
        if head.startswith(self.TAG):
            head = head[len(self.TAG) :].lstrip()
        elif self.TAG.startswith(head):
            return []  # maybe the tag, not complete yet
        if not head:
            return []
        held, self._held = self._held, ""
        if head.startswith("{"):
            self._mode = "calls"
            return self._scanner.feed(head)
        self._mode = "content"
        return [ContentDelta(held)]

    def finish(self) -> list[Event]:
        held, self._held = self._held, ""
        return [ContentDelta(held)] if held and self._mode is None else []


class RequiredParser(ToolCallParser):
    """The JSON array `tool_choice: required` constrains the output to."""

    def __init__(self) -> None:
        self._scanner = _CallScanner(("parameters",), call_depth=1)

    def feed(self, text: str) -> list[Event]:
        return self._scanner.feed(text)


class NamedParser(ToolCallParser):
    """A named tool choice: the whole output is the function's arguments."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._started = False

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        if not self._started:
            self._started = True
            events.append(CallStart(0, self._name))
        if text:
            events.append(ArgumentsDelta(0, text))
        return events

    def finish(self) -> list[Event]:
        return self.feed("") if not self._started else []


class ParsedOutput(msgspec.Struct, kw_only=True):
    """A whole choice's events assembled: content and (name, arguments) per call."""

    content: str = ""
    calls: list[tuple[str, str]] = msgspec.field(default_factory=list)

    def add(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, ContentDelta):
                self.content += event.text
            elif isinstance(event, CallStart):
                self.calls.append((event.name, ""))
            else:
                name, arguments = self.calls[event.index]
                self.calls[event.index] = (name, arguments + event.text)
