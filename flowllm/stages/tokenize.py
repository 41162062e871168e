"""tokenize: prompt text or chat messages to token ids; the context-length check.

Chat requests are rendered by `flowllm.text.chat_prompt` (the model's chat template or
the request's own, tools and tool turns included), which `/tokenize` renders with too,
then encoded without adding special tokens again, as the template already holds them.
Stateless but for a cache of which server templates render tools, and the encoding runs
in a worker thread (the tokenizer releases the GIL), so `replicas: N` tokenizes N
prompts at once.

A pooling request generates nothing: its prompt may fill the context, and it runs as a
sequence of one step's output (`max_tokens` 1, which pool's finishing entry ends). A
cross-encoder's pair (`text_pair`) is encoded as the tokenizer joins two texts, and where
the second one's token type starts goes with it (`PoolingParams.token_type_start`).
"""

from __future__ import annotations

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
from flowllm.text.chat_prompt import ChatPrompts
from flowllm.text.chat_template import ChatTemplateError
from flowllm.validation import check_context_length, check_pooling_length


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
        self._chat_prompts = ChatPrompts(self._tokenizer)

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
            try:
                text = self._chat_prompts.text(
                    request.messages,
                    tools=request.tools,
                    chat_template=request.chat_template,
                    add_generation_prompt=request.add_generation_prompt,
                    template_kwargs=request.chat_template_kwargs,
                )
            except ChatTemplateError as e:
                raise PromptError(e.message, e.param, e.code) from e
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
        else:
            ids = tuple(tokenizer.encode(request.prompt or ""))
        if not ids:  # the one check of an empty prompt, whatever form it came in
            empty = "empty_array" if request.prompt_token_ids is not None else "empty_string"
            raise PromptError("The prompt cannot be empty.", "prompt", empty)
        return ids
