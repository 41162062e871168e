"""Hypothesis strategies for HTTP requests to every endpoint: bodies drawn from the JSON
schemas of the request structs (`msgspec.json.schema`), and the mutations that break
servers: integers past 64 bits, floats at the edges, long strings and lists, deep nesting,
invalid UTF-8, truncated JSON, duplicate keys, wrong types and content types, huge `n`,
huge `max_tokens` and many prompts.

Valid-looking bodies are kept cheap to serve (a few tokens, `n` of at most 2), so ten
thousand cases run in about a minute against the tiny GPT-2.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec
from hypothesis import strategies as st

from flowllm.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
POST_ENDPOINTS: dict[str, type[msgspec.Struct]] = {
    COMPLETIONS: CompletionRequest,
    CHAT: ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
GET_ENDPOINTS = ("/health", "/version", "/v1/models", "/metrics")
MAX_SHOWN = 600  # characters of a body shown in a failure message


@dataclass(frozen=True)
class Case:
    """One HTTP request; `how` says which strategy built it."""

    method: str
    path: str
    body: bytes | None = None
    content_type: str | None = "application/json"
    headers: tuple[tuple[str, str], ...] = ()
    how: str = ""

    def request_headers(self) -> dict[str, bytes]:
        """Header values as latin-1 bytes, as they go on the wire."""
        headers = {name: value.encode("latin-1") for name, value in self.headers}
        if self.content_type is not None:
            headers["content-type"] = self.content_type.encode("latin-1")
        return headers

    def describe(self) -> str:
        lines = [f"{self.method} {self.path}  [{self.how}]"]
        if self.content_type is not None:
            lines.append(f"content-type: {self.content_type}")
        lines += [f"{name}: {value[:200]!r}" for name, value in self.headers]
        if self.body is not None:
            shown = self.body[:MAX_SHOWN]
            more = len(self.body) - len(shown)
            lines.append(f"body ({len(self.body)} bytes): {shown!r}")
            if more:
                lines.append(f"... {more} more bytes")
        return "\n".join(lines)

    def __repr__(self) -> str:  # what Hypothesis prints as the falsifying example
        return f"Case(\n{self.describe()}\n)"


# ---------------------------------------------------------------------------------------
# JSON text with values Python's json cannot write (1e400, 400 digits, deep nesting...)


@dataclass(frozen=True)
class Raw:
    """JSON text inserted as is."""

    text: str


@dataclass(frozen=True)
class Pairs:
    """A JSON object written key by key, so keys may repeat."""

    items: tuple[tuple[str, Any], ...]


def dump(value: Any) -> str:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, Pairs):
        return "{" + ",".join(f"{json.dumps(k)}:{dump(v)}" for k, v in value.items) + "}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{dump(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(dump(v) for v in value) + "]"
    return json.dumps(value)  # NaN and Infinity come out as JavaScript writes them


def encode(value: Any) -> bytes:
    return dump(value).encode("utf-8", errors="surrogatepass")


# ---------------------------------------------------------------------------------------
# Bodies from the request structs' JSON schemas

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
small_ints = st.one_of(st.integers(-3, 40), st.integers(-(2**66), 2**66))
token_ids = st.one_of(st.integers(0, 50256), st.integers(-(2**65), 2**65))
prompt_text = st.text(max_size=60)


def from_schema(schema: dict[str, Any], defs: dict[str, Any], name: str = "") -> Any:
    """A strategy for instances of the subset of JSON Schema msgspec writes."""
    if "$ref" in schema:
        ref = schema["$ref"].rsplit("/", 1)[-1]
        return st.deferred(lambda: from_schema(defs[ref], defs, name))
    if "anyOf" in schema:
        return st.one_of([from_schema(option, defs, name) for option in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        return token_ids if "token" in name else small_ints
    if kind == "number":
        return st.one_of(st.floats(-3, 3), st.floats(allow_nan=False, allow_infinity=False))
    if kind == "string":
        return prompt_text
    if kind == "array":
        items = schema.get("items")
        item = from_schema(items, defs, name) if items else json_values
        return st.lists(item, max_size=4)
    if kind == "object":
        properties = schema.get("properties")
        if properties is None:  # a dict: logit_bias's keys are token ids as strings
            values = from_schema(schema.get("additionalProperties", {}), defs, name)
            keys = st.one_of(token_ids.map(str), st.text(max_size=6))
            return st.dictionaries(keys, values, max_size=4)
        required = set(schema.get("required", ()))
        fields = {key: from_schema(sub, defs, key) for key, sub in properties.items()}
        return st.fixed_dictionaries(
            {key: value for key, value in fields.items() if key in required},
            optional={key: value for key, value in fields.items() if key not in required},
        )
    return json_values  # no type: any JSON value


def schema_strategy(struct: type[msgspec.Struct]) -> st.SearchStrategy[dict[str, Any]]:
    schema = msgspec.json.schema(struct)
    return from_schema(schema, schema.get("$defs", {}))


def cheap(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The same request, but cheap to serve: at most 4 new tokens and 2 choices."""
    body = dict(body)
    if path in (COMPLETIONS, CHAT):
        for key in ("max_tokens", "max_completion_tokens"):
            value = body.get(key)
            if isinstance(value, int) and value > 4:
                body[key] = value % 5
        if path == CHAT and body.get("max_tokens") is None:
            body.setdefault("max_completion_tokens", 3)  # None would run to the context's end
        n = body.get("n")
        if isinstance(n, int) and n > 2:
            body["n"] = 2
    return body


def schema_cases() -> st.SearchStrategy[Case]:
    def for_path(path: str) -> st.SearchStrategy[Case]:
        return schema_strategy(POST_ENDPOINTS[path]).map(
            lambda body: Case("POST", path, encode(cheap(path, body)), how="schema")
        )

    return st.one_of([for_path(path) for path in POST_ENDPOINTS])


# ---------------------------------------------------------------------------------------
# Mutations: one field of a small valid body replaced by a value that breaks servers

BASE_BODIES: dict[str, dict[str, Any]] = {
    COMPLETIONS: {"prompt": "Hello", "max_tokens": 2},
    CHAT: {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/tokenize": {"prompt": "Hello"},
    "/detokenize": {"tokens": [15496, 11]},
}


def _deep_list(depth: int) -> Raw:
    return Raw("[" * depth + "]" * depth)


def _deep_object(depth: int) -> Raw:
    return Raw('{"a":' * depth + "1" + "}" * depth)


EDGE_INTEGERS: list[Any] = [
    -1, 0, 1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1,
    2**64 - 1, 2**64, -(2**64), 10**18, Raw("9" * 400), Raw("-" + "9" * 400), Raw("1" + "0" * 4000),
]  # fmt: skip
EDGE_FLOATS: list[Any] = [
    1e308, -1e308, 1.7976931348623157e308, Raw("1e400"), Raw("-1e400"), Raw("1e-400"),
    -0.0, 5e-324, -5e-324, 2.2250738585072014e-308, float("nan"), float("inf"),
    float("-inf"), Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("0." + "0" * 400 + "1"),
    Raw("1" * 400 + ".5"), 1.0, 0.5, 1e-9,
]  # fmt: skip
EDGE_STRINGS: list[Any] = [
    "", " ", "\x00", "a" * 100_000, "😀" * 20_000, "<|endoftext|>" * 300, "\ud800", "\udfff",
    "\u202e\u0000\uffff", "\\", '"', "null", "1e400", "%s%n%x" * 100, "é" * 50_000,
    Raw('"\\ud800\\udc00"'), Raw('"\\u0000"'), Raw('"\\uZZZZ"'),
]  # fmt: skip
WRONG_TYPES: list[Any] = [None, True, False, {}, [], [None], {"a": 1}, "text", 1.5, 3]
LONG_LISTS: list[Any] = [
    [1] * 100_000, [50256] * 5000, ["x"] * 10_000, [[1]] * 10_000, [None] * 1000,
    [{"role": "user", "content": "x"}] * 5000, list(range(50_000)),
]  # fmt: skip
DEEP: list[Any] = [_deep_list(d) for d in (100, 1000, 5000, 100_000)] + [
    _deep_object(d) for d in (1000, 10_000)
]

edge_values = st.one_of(
    st.sampled_from(EDGE_INTEGERS),
    st.sampled_from(EDGE_FLOATS),
    st.sampled_from(EDGE_STRINGS),
    st.sampled_from(WRONG_TYPES),
    st.sampled_from(LONG_LISTS),
    st.sampled_from(DEEP),
)

FIELDS: dict[str, list[str]] = {
    path: [f.encode_name for f in msgspec.structs.fields(struct)]
    for path, struct in POST_ENDPOINTS.items()
}


def mutated_cases() -> st.SearchStrategy[Case]:
    @st.composite
    def build(draw: st.DrawFn) -> Case:
        path = draw(st.sampled_from(sorted(POST_ENDPOINTS)))
        body = dict(BASE_BODIES[path])
        for _ in range(draw(st.integers(1, 2))):
            key = draw(st.one_of(st.sampled_from(FIELDS[path]), st.sampled_from(["x", "", "é"])))
            body[key] = draw(edge_values)
        return Case("POST", path, encode(body), how=f"mutated {sorted(body)}")

    return build()


def _completion(**fields: Any) -> tuple[str, dict[str, Any]]:
    return COMPLETIONS, {"prompt": "Hi", "max_tokens": 1, **fields}


def _chat(**fields: Any) -> tuple[str, dict[str, Any]]:
    return CHAT, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, **fields}


# Targeted requests: the limits that matter for a server's memory and time.
TARGETED: list[tuple[str, dict[str, Any]]] = [
    _completion(n=2**31), _completion(n=10**6), _completion(n=1000), _completion(n=17),
    _completion(n=16, max_tokens=2), _completion(n=2**64),
    _completion(max_tokens=2**31), _completion(max_tokens=10**9), _completion(max_tokens=2**63),
    _completion(max_tokens=Raw("9" * 400)), _completion(max_tokens=0),
    _completion(prompt=["Hi"] * 64), _completion(prompt=["Hi"] * 1000),
    _completion(prompt=["Hi"] * 20_000), _completion(prompt=[[1, 2]] * 2000),
    _completion(prompt=[[]] * 10), _completion(prompt=[50256] * 511),
    _completion(prompt=[50256] * 100_000), _completion(prompt="hello " * 20_000),
    _completion(prompt=["Hi"] * 100, n=16), _completion(logprobs=20, prompt_logprobs=20),
    _completion(logprobs=2**63), _completion(echo=True, logprobs=5, max_tokens=0),
    _completion(stop=["x"] * 10_000), _completion(stop="a" * 100_000),
    _completion(stop_token_ids=[2**63] * 100), _completion(stop_token_ids=list(range(100_000))),
    _completion(logit_bias={str(i): 100 for i in range(50_000)}),
    _completion(logit_bias={"99999999999999999999999": 1}), _completion(logit_bias={"-1": 1}),
    _completion(logit_bias={"abc": 1}), _completion(logit_bias={"1": Raw("1e400")}),
    _completion(seed=2**64), _completion(seed=-(2**63) - 1), _completion(top_k=2**63),
    _completion(min_tokens=2**40, max_tokens=None), _completion(temperature=Raw("1e400")),
    _completion(stream=True, n=16, max_tokens=3), _completion(stream=True, logprobs=20),
    _completion(
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}
    ),
    _chat(messages=[{"role": "user", "content": "x"}] * 5000),
    _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "x"}] * 5000}]),
    _chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
    _chat(messages=[]), _chat(messages=[{"role": "system"}]), _chat(n=2**31),
    _chat(max_completion_tokens=2**63), _chat(top_logprobs=2**31, logprobs=True),
    _chat(chat_template="{% for i in range(10**9) %}x{% endfor %}"),
    _chat(chat_template="{{ 'x' * 10**10 }}"), _chat(chat_template="{% if %}"),
    _chat(chat_template="{{ raise_exception('boom') }}"),
    _chat(chat_template="{{ ''.__class__.__mro__ }}"), _chat(response_format={"type": "json"}),
    _chat(stream=True, n=16, max_tokens=3), _chat(logprobs=True, top_logprobs=20, n=4),
    ("/tokenize", {"prompt": "hello " * 100_000}),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}] * 10_000}),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                   "chat_template": "{% for i in range(10**9) %}x{% endfor %}"}),
    ("/tokenize", {"prompt": "x", "messages": []}), ("/tokenize", {}),
    ("/detokenize", {"tokens": list(range(50_000))}), ("/detokenize", {"tokens": [2**63]}),
    ("/detokenize", {"tokens": [-(2**63) - 1]}), ("/detokenize", {"tokens": [50257]}),
    ("/detokenize", {"tokens": [50256] * 200_000}),
]  # fmt: skip


def targeted_cases() -> st.SearchStrategy[Case]:
    return st.sampled_from(TARGETED).map(
        lambda target: Case("POST", target[0], encode(target[1]), how="targeted")
    )


# ---------------------------------------------------------------------------------------
# Bytes that are not the JSON a handler expects

RAW_BODIES: list[bytes] = [
    b"", b" ", b"null", b"[]", b"1", b'"text"', b"{", b"}", b"{}", b"{]", b"\x00",
    b'{"prompt": "\xff\xfe", "max_tokens": 1}', b'{"prompt": "\xc3\x28"}',
    b'{"prompt": "\xc0\xaf"}',
    b'{"prompt": "\xed\xa0\x80"}', b'{"prompt": "\xf4\x90\x80\x80"}', b"\xef\xbb\xbf{}",
    '{"prompt": "hi"}'.encode("utf-16"), '{"prompt": "hi"}'.encode("utf-32"),
    b'{"prompt":"a","prompt":[1],"max_tokens":1,"max_tokens":-1}',
    b'{"messages":[],"messages":[{"role":"user","content":"x"}],"max_tokens":1}',
    b'{"tokens":[1],"tokens":"x"}', b'{"prompt":"a"} trailing', b'{"prompt":"a"}{"prompt":"b"}',
    b'{"prompt":"a",}', b"{'prompt': 'a'}", b'{"prompt":"a\x01b"}', b'{"prompt":1e400}',
    b'{"prompt": "' + b"\\" * 10_001 + b'"}', b"[" * 100_000, b"{" * 100_000,
    b'{"a":' * 50_000, b" " * 1_000_000 + b"{}",
]  # fmt: skip


def raw_cases() -> st.SearchStrategy[Case]:
    paths = st.sampled_from(sorted(POST_ENDPOINTS))
    fixed = st.builds(
        lambda path, body: Case("POST", path, body, how="raw"), paths, st.sampled_from(RAW_BODIES)
    )
    random_bytes = st.builds(
        lambda path, body: Case("POST", path, body, how="random bytes"), paths, st.binary()
    )

    @st.composite
    def truncated(draw: st.DrawFn) -> Case:
        path = draw(paths)
        body = encode(BASE_BODIES[path])
        cut = draw(st.integers(0, len(body) - 1))
        return Case("POST", path, body[:cut], how=f"truncated at {cut}")

    return st.one_of(fixed, random_bytes, truncated())


CONTENT_TYPES = [
    None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
    "application/json; charset=latin-1", "application/json; charset=utf-16", "application/xml",
    "application/octet-stream", "", "*/*", "application/json, text/plain", "appl\tication/json",
]  # fmt: skip


def content_type_cases() -> st.SearchStrategy[Case]:
    @st.composite
    def build(draw: st.DrawFn) -> Case:
        path = draw(st.sampled_from(sorted(POST_ENDPOINTS)))
        body = draw(
            st.one_of(
                st.just(encode(BASE_BODIES[path])),
                st.just(b"prompt=Hello&max_tokens=1"),
                st.just(b"--x\r\nContent-Disposition: form-data; name=prompt\r\n\r\nHi\r\n--x--"),
            )
        )
        content_type = draw(st.sampled_from(CONTENT_TYPES))
        return Case("POST", path, body, content_type=content_type, how="content type")

    return build()


# Request ids are echoed in a response header: odd ones must not break the response.
REQUEST_IDS = ["", "x" * 8000, "é" * 100, "a\tb", "../../etc/passwd", "ÿ"]


def header_cases() -> st.SearchStrategy[Case]:
    return st.builds(
        lambda path, request_id: Case(
            "POST",
            path,
            encode(BASE_BODIES[path]),
            headers=(("x-request-id", request_id),),
            how="request id",
        ),
        st.sampled_from(sorted(POST_ENDPOINTS)),
        st.sampled_from(REQUEST_IDS),
    )


def other_method_cases() -> st.SearchStrategy[Case]:
    paths = [*GET_ENDPOINTS, *POST_ENDPOINTS, "/", "/v1", "/v1/", "/nope", "/v1/models/x",
             "/health?x=" + "a" * 4000, "/%ff", "/v1/completions/", "/v1//completions",
             "/v1/completions?stream=true", "/../../etc/passwd"]  # fmt: skip
    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
    return st.builds(
        lambda method, path, body: Case(
            method, path, body, content_type="application/json" if body else None, how="method"
        ),
        st.sampled_from(methods),
        st.sampled_from(paths),
        st.sampled_from([None, b"{}", b'{"prompt": "x"}']),
    )


def get_cases() -> st.SearchStrategy[Case]:
    return st.sampled_from(GET_ENDPOINTS).map(
        lambda path: Case("GET", path, content_type=None, how="get")
    )


def all_cases() -> st.SearchStrategy[Case]:
    """Every kind of case; the schema bodies and their mutations the most often."""
    return st.one_of(
        schema_cases(),
        schema_cases(),
        mutated_cases(),
        mutated_cases(),
        targeted_cases(),
        raw_cases(),
        content_type_cases(),
        header_cases(),
        other_method_cases(),
        get_cases(),
    )
