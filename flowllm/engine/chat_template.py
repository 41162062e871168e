"""Chat prompts rendered with a Jinja chat template, failures answered as the client's.

Shared by the tokenize stage and the `/tokenize` route. Rendering runs the template's code:
whatever it raises (`raise_exception`, an undefined attribute, a type error...) is the
request's fault, a 400, never an exception escaping a stage.
"""

from __future__ import annotations

from typing import Any

_MAX_REASON = 300  # characters of the template's own error message kept in ours


class PromptError(ValueError):
    """The prompt cannot be tokenized; the message says why (becomes a 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, str]],
    *,
    template: str | None,
    add_generation_prompt: bool,
    template_given: bool,
) -> str:
    """The chat prompt as text; PromptError (a 400) when the template fails to render.

    Any exception while rendering is the template's or the messages' fault: a request's
    own template (`template_given`) is named as `chat_template`, else the messages are.
    """
    try:
        text = tokenizer.apply_chat_template(
            messages,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
    except Exception as exc:
        param = "chat_template" if template_given else "messages"
        reason = str(exc) or type(exc).__name__
        if len(reason) > _MAX_REASON:
            reason = reason[:_MAX_REASON] + "..."
        raise PromptError(f"The chat template failed to render: {reason}", param) from exc
    if not isinstance(text, str):
        raise PromptError("The chat template did not render to text.", "chat_template")
    return text
