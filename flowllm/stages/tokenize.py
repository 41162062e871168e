"""tokenize: prompt text or chat messages to token ids; the context-length check.

Chat requests are rendered with the model's chat template by transformers, or with the
template given with the request within the request-template budget
(`flowllm.text.chat_template`), tools and tool turns included (natively, or by the
fallback of `flowllm.text.tool_prompt` for a template that ignores tools), then
encoded without adding special tokens again, as the template already holds them.
Stateless but for a cache of which server templates render tools, and the encoding runs
in a worker thread (the tokenizer releases the GIL), so `replicas: N` tokenizes N
prompts at once.

A pooling request generates nothing: its prompt may fill the context, and it runs as a
sequence of one step's output (`max_tokens` 1, which pool's finishing entry ends). A
cross-encoder's pair (`text_pair`) is encoded as the tokenizer joins two texts, and where
the second one's token type starts goes with it (`PoolingParams.token_type_start`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio.to_thread
import msgspec

from flowllm.graph.stage import NoParams, PerMessageStage, StageContext
from flowllm.messages import (
    Abort,
    GenerateRequest,
    PoolingParams,
    RequestError,
    TokenizedRequest,
    ValidRequest,
)
from flowllm.stages.services import EngineServices
from flowllm.text.chat_template import DEFAULT_BUDGET, ChatTemplateError, render_chat
from flowllm.text.tool_prompt import PROBE_MESSAGES, renders_tools, template_messages
from flowllm.validation import check_context_length, check_pooling_length

# Renders messages (and tools, or None) with the request's chat template.
_Render = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str]


class PromptError(ValueError):
    """The prompt cannot be tokenized; the message says why (becomes a 400)."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class Tokenize(PerMessageStage):
    inputs = {"in": ValidRequest | Abort}
    outputs = {"out": TokenizedRequest | Abort, "errors": RequestError}

    def __init__(self, params: NoParams, services: EngineServices) -> None:
        super().__init__(params, services)
        self._tokenizer = services.tokenizer
        self._max_model_len = services.max_model_len
        self._eos_token_ids = services.eos_token_ids
        self._template_tools: dict[str, bool] = {}  # server templates: do they render tools?

    async def handle(self, message: ValidRequest | Abort, ctx: StageContext) -> None:
        if isinstance(message, Abort):
            await ctx.emit("out", message)
            return
        request = message.request
        pooling = request.pooling
        try:
            if request.prompt_token_ids is not None:
                # ids are taken as they are (validate checked them): no worker-thread hop
                prompt_ids = self.prompt_token_ids(request)
            elif request.text_pair is not None:
                prompt_ids, type_start = await anyio.to_thread.run_sync(self.pair_ids, request)
                pooling = msgspec.structs.replace(
                    pooling or PoolingParams(), token_type_start=type_start
                )
            else:
                prompt_ids = await anyio.to_thread.run_sync(self.prompt_token_ids, request)
        except PromptError as e:
            refusal = RequestError(
                request_id=request.request_id, message=str(e), param=e.param, code=e.code
            )
            await ctx.emit("errors", refusal)
            return
        if pooling is not None:
            max_tokens: int = 1
            error = check_pooling_length(request.request_id, len(prompt_ids), self._max_model_len)
        else:
            max_tokens, error = check_context_length(
                request.request_id, len(prompt_ids), request.params.max_tokens, self._max_model_len
            )
        if error is not None:
            await ctx.emit("errors", error)
            return
        prompt_text = None
        if request.echo:
            prompt_text = request.prompt
            if prompt_text is None:
                # transformers types decode as taking lists and returning `str | list[str]`
                # (for batches); a tuple of ids decodes to one str.
                prompt_text = self._tokenizer.decode(prompt_ids)  # type: ignore[arg-type,assignment]
        await ctx.emit(
            "out",
            TokenizedRequest(
                request_id=request.request_id,
                prompt_token_ids=prompt_ids,
                params=msgspec.structs.replace(request.params, max_tokens=max_tokens),
                eos_token_ids=self._eos_token_ids,
                arrival_time=request.arrival_time,
                prompt_text=prompt_text,
                cache_salt=request.cache_salt,
                pooling=pooling,
            ),
        )

    def _renders_tools(self, template: str, from_request: bool, render: _Render) -> bool:
        """Whether the template renders tools (probed once per server template; a
        request's template is probed each time, within its budget)."""
        known = self._template_tools.get(template)
        if known is None:
            known = renders_tools(lambda tools: render(list(PROBE_MESSAGES), tools))
            if not from_request:
                self._template_tools[template] = known
        return known

    def pair_ids(self, request: GenerateRequest) -> tuple[tuple[int, ...], int | None]:
        """A cross-encoder pair's token ids (`prompt` then `text_pair`, joined by the
        tokenizer's own template) and the position where token type 1 starts (None: the
        tokenizer gives every token type 0)."""
        encoded = self._tokenizer(request.prompt or "", request.text_pair)
        ids = tuple(encoded["input_ids"])
        types = encoded.get("token_type_ids") or ()
        start = next((i for i, t in enumerate(types) if t), None)
        return ids, start

    def prompt_token_ids(self, request: GenerateRequest) -> tuple[int, ...]:
        """The request's prompt as token ids; PromptError when it has none."""
        tokenizer = self._tokenizer
        if request.prompt_token_ids is not None:
            ids = request.prompt_token_ids  # validate checked them against the vocabulary
        elif request.messages is not None:
            template = request.chat_template or tokenizer.chat_template
            if template is None:
                raise PromptError(
                    "As of transformers v4.44, default chat template is no longer allowed, "
                    "so you must provide a chat template if the tokenizer does not define "
                    "one.",
                    "messages",
                )
            budget = DEFAULT_BUDGET if request.chat_template is not None else None

            def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
                return render_chat(
                    tokenizer,
                    messages,
                    template=template,
                    add_generation_prompt=request.add_generation_prompt,
                    template_kwargs=request.chat_template_kwargs,
                    budget=budget,
                    tools=tools,
                )

            try:
                messages, tools = template_messages(
                    request.messages,
                    request.tools,
                    lambda: self._renders_tools(template, budget is not None, render),
                )
                text = render(messages, tools)
            except ChatTemplateError as e:
                raise PromptError(e.message, e.param, e.code) from e
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
        else:
            ids = tuple(tokenizer.encode(request.prompt or ""))
        if not ids:  # the one check of an empty prompt, whatever form it came in
            empty = "empty_array" if request.prompt_token_ids is not None else "empty_string"
            raise PromptError("The prompt cannot be empty.", "prompt", empty)
        return ids
