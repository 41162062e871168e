"""A chat request's prompt text: its turns and tools rendered with its chat template.

The graph's tokenize stage renders every chat prompt a generation runs on, and the API's
`/tokenize` reports the ids of one; both render through `ChatPrompts`, so `/tokenize`
counts exactly the tokens a generation of the same request would run on.

The template is the request's own when it brings one (rendered within the
request-template budget, `flowllm.text.chat_template`), else the tokenizer's, which the
loader already replaced with `--chat-template` when one was given. Tools and tool turns
are rendered natively by a template that shows tools, or by the fallback of
`flowllm.text.tool_prompt` for one that ignores them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flowllm.messages import ChatMessage
from flowllm.text.chat_template import (
    DEFAULT_BUDGET,
    ChatTemplateError,
    TemplateBudget,
    render_chat,
)
from flowllm.text.tool_prompt import PROBE_MESSAGES, renders_tools, template_messages

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# vLLM's wording for a chat request the server has no template for.
NO_CHAT_TEMPLATE = (
    "As of transformers v4.44, default chat template is no longer allowed, so you must "
    "provide a chat template if the tokenizer does not define one."
)

# Renders messages (and tools, or None) with one request's chat template.
_Render = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str]


class ChatPrompts:
    """Chat prompts of one tokenizer. Probing whether a template renders tools costs two
    renders, so the answer is kept for the server's templates; a request's own template
    is probed each time, within its budget."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, budget: TemplateBudget = DEFAULT_BUDGET
    ) -> None:
        self.tokenizer = tokenizer
        self.budget = budget  # for templates that come with a request
        self._template_tools: dict[str, bool] = {}

    def text(
        self,
        messages: tuple[ChatMessage, ...],
        *,
        tools: tuple[dict[str, Any], ...] | None,
        chat_template: str | None,
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None,
    ) -> str:
        """The prompt text of a chat request. `chat_template`: the request's own (None: the
        tokenizer's). ChatTemplateError when there is no template, or it fails."""
        tokenizer = self.tokenizer
        template = chat_template or tokenizer.chat_template
        if template is None:
            raise ChatTemplateError(
                NO_CHAT_TEMPLATE, param="chat_template", code="missing_chat_template"
            )
        budget = self.budget if chat_template is not None else None

        def render(turns: list[dict[str, Any]], shown: list[dict[str, Any]] | None) -> str:
            return render_chat(
                tokenizer,
                turns,
                template=template,
                add_generation_prompt=add_generation_prompt,
                template_kwargs=template_kwargs,
                budget=budget,
                tools=shown,
            )

        turns, shown = template_messages(
            messages, tools, lambda: self._renders_tools(template, budget is not None, render)
        )
        return render(turns, shown)

    def _renders_tools(self, template: str, from_request: bool, render: _Render) -> bool:
        """Whether the template renders tools (probed once per server template)."""
        known = self._template_tools.get(template)
        if known is None:
            known = renders_tools(lambda tools: render(list(PROBE_MESSAGES), tools))
            if not from_request:
                self._template_tools[template] = known
        return known
