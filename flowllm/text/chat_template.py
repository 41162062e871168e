"""Rendering chat templates: the server's own with transformers, a request's within a budget.

A template that comes with a request (`chat_template`, refused unless the server runs with
`--trust-request-chat-template`) is client-supplied code. transformers renders templates in
Jinja's immutable sandbox, which stops escapes to Python but not CPU or memory: two nested
`range(100000)` loops keep a thread busy for minutes. Request templates are therefore
rendered by `render_chat` with a `TemplateBudget`:

* the template is compiled in a copy of transformers' own sandboxed environment (same
  options, filters, globals such as `raise_exception`, `tojson`, `namespace`, extensions),
  so it renders exactly as `tokenizer.apply_chat_template` would render it;
* that copy checks the deadline on every loop iteration (each `for` iterable is wrapped
  in a checking iterator when compiled), every call, attribute and item read, filter and
  intercepted operator (`*`, `**`, `%`, `+`);
* it refuses operations whose result would exceed the size budget before running them
  where the size is known up front (`s * n`, `x ** n`, integer arguments such as widths
  larger than the budget, format widths), and checks the size of every call's, filter's,
  operator's and `~` concatenation's result;
* the template's output is consumed piece by piece (`Template.generate`), counting its
  characters and checking the deadline after each piece.

Checks run between Python operations, so one operation can overrun the deadline by its
own duration, and a single operation that serialises a structure built from many shared
references (e.g. printing a list nested by doubling) allocates before its size is seen.
The budget keeps a trusted client's mistake from tying up the server; it is not a reason
to accept templates from untrusted clients.

Templates configured on the server (`--chat-template`, the model's own) are trusted and
rendered by `tokenizer.apply_chat_template` unchanged. A request's `chat_template_kwargs`
(extra template variables, such as Qwen3's `enable_thinking`) are data, not code, and are
accepted from any client as vLLM accepts them: bounded in number, nesting and size before
anything renders (`check_template_kwargs`), and never one of the names the server sets.
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import jinja2
from jinja2 import nodes
from jinja2.sandbox import SandboxedEnvironment

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from flowllm.config import RequestLimits

# Names transformers' renderer or `apply_chat_template` already use; a request's
# `chat_template_kwargs` may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "conversations",
        "add_generation_prompt",
        "continue_final_message",
        "tools",
        "documents",
        "chat_template",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)

_ITER_FILTER = "flowllm_budget_iter"
_CONCAT_FILTER = "flowllm_budget_concat"
_CHECK_EVERY = 64  # loop iterations between deadline checks
_MAX_INT_BITS = 1 << 16  # integers a template may build (~20,000 decimal digits)
_DIGITS = re.compile(r"\d+")
_MAX_REASON = 300  # characters of the template's own error message kept in ours


class TemplateBudget:
    """How long a request's template may render and how much text it may produce."""

    __slots__ = ("max_chars", "seconds")

    def __init__(self, seconds: float = 2.0, max_chars: int = 4 * 2**20) -> None:
        self.seconds = seconds
        self.max_chars = max_chars


DEFAULT_BUDGET = TemplateBudget()


class ChatTemplateError(ValueError):
    """A chat template cannot render these messages; becomes a 400 naming `param`."""

    def __init__(self, message: str, *, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class TemplateBudgetExceeded(jinja2.TemplateError):
    """A request's chat template ran out of time or output size (templates cannot catch
    it: Jinja has no try/except)."""


class _Meter:
    """The running render's deadline and size limit (one per render, in a ContextVar)."""

    __slots__ = ("budget", "deadline")

    def __init__(self, budget: TemplateBudget) -> None:
        self.budget = budget
        self.deadline = time.monotonic() + budget.seconds

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateBudgetExceeded(
                f"the chat template did not finish within {self.budget.seconds:g} s"
            )

    def too_big(self, what: str) -> TemplateBudgetExceeded:
        return TemplateBudgetExceeded(
            f"the chat template would build {what} larger than the "
            f"{self.budget.max_chars}-character budget"
        )

    def check_size(self, value: Any) -> Any:
        if isinstance(value, (str, list, tuple, dict, set, frozenset, bytes)):
            if len(value) > self.budget.max_chars:
                raise self.too_big("a value")
        elif isinstance(value, int) and value.bit_length() > _MAX_INT_BITS:
            raise self.too_big("an integer")
        return value

    def check_args(self, args: Iterable[Any]) -> None:
        limit = self.budget.max_chars
        for arg in args:
            if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > limit:
                raise self.too_big("a value (an argument of " + str(arg) + ")")

    def check_format(self, fmt: Any) -> None:
        """Widths and precisions in a %-format or str.format string."""
        if isinstance(fmt, str):
            limit = self.budget.max_chars
            for digits in _DIGITS.findall(fmt):
                if len(digits) > 12 or int(digits) > limit:
                    raise self.too_big("a formatted value")


_METER: ContextVar[_Meter | None] = ContextVar("flowllm_template_meter", default=None)


def _meter() -> _Meter:
    meter = _METER.get()
    if meter is None:  # a budgeted template rendered outside render_chat
        raise TemplateBudgetExceeded("a budgeted chat template needs an active budget")
    return meter


def _budget_iter(value: Any) -> Iterator[Any]:
    meter = _meter()
    meter.tick()
    for i, item in enumerate(value):
        if i % _CHECK_EVERY == 0:
            meter.tick()
        yield item


def _budget_concat(parts: Sequence[Any]) -> str:
    meter = _meter()
    meter.tick()
    return meter.check_size("".join(map(str, parts)))  # type: ignore[no-any-return]


def _guard(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """A filter that checks the budget before and after it runs (keeps Jinja's pass_*)."""

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        meter = _meter()
        meter.tick()
        meter.check_args(args)
        meter.check_args(kwargs.values())
        if name == "format" and args:
            meter.check_format(args[0])
        return meter.check_size(fn(*args, **kwargs))

    return guarded


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    if n > 100 or max > 1000:
        raise _meter().too_big("lorem ipsum")
    from jinja2.utils import generate_lorem_ipsum

    return generate_lorem_ipsum(n=n, html=html, min=min, max=max)


class _BudgetMixin:
    """Deadline and size checks on the sandbox's hooks; mixed into transformers' class."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        meter = _meter()
        meter.tick()
        meter.check_args(args)
        meter.check_args(kwargs.values())
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
        if getattr(method, "__name__", None) in ("format", "format_map"):
            meter.check_format(getattr(method, "__self__", None))
        result = super().call(__context, __obj, *args, **kwargs)  # type: ignore[misc]
        return meter.check_size(result)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        meter = _meter()
        meter.tick()
        limit = meter.budget.max_chars
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                sized = isinstance(seq, (str, list, tuple)) and isinstance(n, int)
                if sized and len(seq) * n > limit:
                    raise meter.too_big("a repeated value")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if abs(left) > 1 and right > 0 and abs(left).bit_length() * right > _MAX_INT_BITS:
                raise meter.too_big("an integer")
        elif operator == "%" and isinstance(left, str):
            meter.check_format(left)
            if "*" in left:
                meter.check_args(right if isinstance(right, tuple) else (right,))
        result = super().call_binop(context, operator, left, right)  # type: ignore[misc]
        return meter.check_size(result)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _meter().tick()
        return super().getattr(obj, attribute)  # type: ignore[misc]

    def getitem(self, obj: Any, argument: Any) -> Any:
        _meter().tick()
        return super().getitem(obj, argument)  # type: ignore[misc]


def _wrap_loops_and_concats(tree: nodes.Template) -> nodes.Template:
    """Route every `for` iterable and every `~` through the budget's filters."""
    for loop in tree.find_all(nodes.For):
        loop.iter = nodes.Filter(loop.iter, _ITER_FILTER, [], [], None, None, lineno=loop.lineno)
    for concat in list(tree.find_all(nodes.Concat)):
        parts = nodes.List(list(concat.nodes), lineno=concat.lineno)
        # Concat has one field, `nodes`: turn it into a one-element concat of the checked join.
        checked = nodes.Filter(parts, _CONCAT_FILTER, [], [], None, None, lineno=concat.lineno)
        concat.nodes = [checked]
    return tree


@functools.cache
def _budget_environment() -> SandboxedEnvironment:
    """transformers' chat-template environment, as a subclass with the budget's hooks."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    base = _compile_jinja_template("").environment
    env = base.overlay()
    env.__class__ = type("BudgetedChatTemplateEnvironment", (_BudgetMixin, type(base)), {})
    env.filters = {name: _guard(fn, name) for name, fn in base.filters.items()}
    env.filters[_ITER_FILTER] = _budget_iter
    env.filters[_CONCAT_FILTER] = _budget_concat
    env.globals = dict(base.globals)
    env.globals["lipsum"] = _lipsum
    return env  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=32)
def _compile_budgeted(template: str) -> jinja2.Template:
    env = _budget_environment()
    tree = _wrap_loops_and_concats(env.parse(template))
    return env.template_class.from_code(env, env.compile(tree), env.make_globals(None), None)


def check_template_kwargs(
    kwargs: dict[str, Any] | None, limits: RequestLimits | None = None
) -> dict[str, Any]:
    """Extra template variables, or ChatTemplateError naming a reserved one or, with
    `limits`, a bound they exceed (the number of variables and their nesting first, both
    cheap to count, then their size as JSON)."""
    if not kwargs:
        return {}
    param = "chat_template_kwargs"
    for name in kwargs:
        if name in RESERVED_TEMPLATE_KWARGS:
            raise ChatTemplateError(
                f"Invalid '{param}': {name!r} is set by the server and cannot be given as a "
                "template variable.",
                param=param,
            )
    if limits is None:
        return kwargs
    if len(kwargs) > limits.max_chat_template_kwargs:
        raise ChatTemplateError(
            f"Invalid '{param}': too many variables. Expected at most "
            f"{limits.max_chat_template_kwargs}, but got {len(kwargs)}.",
            param=param,
            code="object_above_max_properties",
        )
    if _nests_deeper(kwargs, limits.max_chat_template_kwargs_depth):
        raise ChatTemplateError(
            f"Invalid '{param}': objects and arrays nest more than "
            f"{limits.max_chat_template_kwargs_depth} levels deep.",
            param=param,
            code="json_too_deep",
        )
    size = len(json.dumps(kwargs, ensure_ascii=False, separators=(",", ":"), default=str))
    if size > limits.max_chat_template_kwargs_chars:
        raise ChatTemplateError(
            f"Invalid '{param}': {size} characters as JSON; expected at most "
            f"{limits.max_chat_template_kwargs_chars}.",
            param=param,
            code="string_above_max_length",
        )
    return kwargs


def _nests_deeper(value: Any, limit: int) -> bool:
    """Whether objects and arrays nest more than `limit` levels in `value` (itself the
    first); stops at the first level past it."""
    level: list[Any] = [value]
    for _ in range(limit):
        level = [
            item
            for container in level
            for item in (container.values() if isinstance(container, dict) else container)
            if isinstance(item, (dict, list, tuple))
        ]
        if not level:
            return False
    return True


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    *,
    template: str | None,
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any] | None = None,
    budget: TemplateBudget | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The chat prompt text for `messages`.

    `template`: the template text, or None for the tokenizer's own. With a `budget` (a
    template that came with the request) it renders in the budgeted copy of transformers'
    environment; without one, `tokenizer.apply_chat_template` renders it. Every failure of
    the template (a syntax error, `raise_exception`, the budget) is a ChatTemplateError.
    """
    kwargs = check_template_kwargs(template_kwargs)
    from_request = budget is not None
    param = "chat_template" if from_request else "messages"
    try:
        if budget is None:
            # transformers types `tools` as an (invariant) list of dicts or functions, and
            # the result as that of every mode; without tokenizing, it is the text.
            text = tokenizer.apply_chat_template(
                messages,
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                tools=tools,  # type: ignore[arg-type]
                **kwargs,
            )
            return text  # type: ignore[return-value]
        return _render_budgeted(
            tokenizer, messages, template, add_generation_prompt, kwargs, budget, tools
        )
    except TemplateBudgetExceeded as e:
        raise ChatTemplateError(
            f"Invalid 'chat_template': {e}.", param="chat_template", code="template_budget_exceeded"
        ) from e
    except ChatTemplateError:
        raise
    except Exception as e:
        # Whatever the template's code raises (`raise_exception`, an undefined attribute,
        # a type error, a division by zero...) is the template's or the messages' fault.
        reason = str(e) if isinstance(e, jinja2.TemplateError) else f"{type(e).__name__}: {e}"
        if len(reason) > _MAX_REASON:
            reason = reason[:_MAX_REASON] + "..."
        raise ChatTemplateError(f"The chat template failed: {reason}", param=param) from e


def _render_budgeted(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    template: str | None,
    add_generation_prompt: bool,
    kwargs: dict[str, Any],
    budget: TemplateBudget,
    tools: list[dict[str, Any]] | None,
) -> str:
    """transformers' `render_jinja_template`, with the budget's checks."""
    if template is None:
        template = tokenizer.get_chat_template()
    meter = _Meter(budget)
    token = _METER.set(meter)
    try:
        compiled = _compile_budgeted(template)
        variables = {**tokenizer.special_tokens_map, **kwargs}
        pieces: list[str] = []
        size = 0
        for piece in compiled.generate(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        ):
            size += len(piece)
            if size > budget.max_chars:
                raise meter.too_big("a prompt")
            meter.tick()
            pieces.append(piece)
        return "".join(pieces)
    finally:
        _METER.reset(token)
