"""A small deterministic engine implementing `EngineClient`, for testing the HTTP API.

It follows the graph's contract without a model: `submit` returns a real `Mailbox`, a
task validates the request with the real `validate_request` / `check_context_length`,
tokenizes with the real tokenizer, then "generates" by a fixed rule that tests can
recompute (`expected_tokens`): choice c's k-th token is the prompt's token (k + c) mod
len(prompt). Logprobs follow fixed formulas too (`gen_logprob`, `prompt_logprob`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskGroup
from litestar import Litestar
from prometheus_client import CollectorRegistry, Counter

from flowllm.api.app import create_app
from flowllm.config import EngineConfig, RequestLimits
from flowllm.mailbox import Mailbox, Overloaded, RequestFailed
from flowllm.messages import Chunk, GenerateRequest, RequestError, TokenLogprobs
from flowllm.text.chat_template import DEFAULT_BUDGET, ChatTemplateError, render_chat
from flowllm.validation import check_admission, check_context_length, validate_request

MODEL = "fake-model"

# A template of our own, so chat prompts can be recomputed in the tests.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def expected_tokens(prompt_ids: list[int] | tuple[int, ...], count: int, choice: int) -> list[int]:
    return [prompt_ids[(k + choice) % len(prompt_ids)] for k in range(count)]


def gen_logprob(step: int, choice: int) -> float:
    return -0.25 * (step + 1) - 0.5 * choice


def prompt_logprob(position: int) -> float:
    return -0.125 * position


def top_entries(token_id: int, logprob: float, n: int, vocab: int) -> tuple[tuple[int, float], ...]:
    """The chosen token first, then ids after it with lower logprobs."""
    return tuple(((token_id + j) % vocab, logprob - j) for j in range(n))


class FakeEngine:
    """Implements the EngineClient protocol; `async with` runs its background tasks."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_model_len: int = 256,
        config: EngineConfig | None = None,
        token_delay: float = 0.0,
        max_pending: int | None = None,
        fail_after: int | None = None,
        max_choices: int = 1024,
        max_prompts: int = 256,
    ) -> None:
        self._tokenizer = tokenizer
        self._max_model_len = max_model_len
        self.config = config or EngineConfig()
        self.token_delay = token_delay
        self.max_pending = max_pending
        self.fail_after = fail_after
        self.max_choices = max_choices  # as ingest's max_pending: never admitted beyond it
        self.max_prompts = max_prompts  # as ingest's channel capacity
        self.is_healthy = True
        self.template_budget = DEFAULT_BUDGET  # for templates that come with a request
        self.submitted: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.completed: list[str] = []
        self._running: dict[str, anyio.CancelScope] = {}
        self._task_group: TaskGroup | None = None
        self.metrics_registry = CollectorRegistry()
        self._requests_total = Counter(
            "flowllm:fake_requests", "Requests submitted.", registry=self.metrics_registry
        )

    # -- EngineClient ---------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return MODEL

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def healthy(self) -> bool:
        return self.is_healthy

    @property
    def accepting(self) -> bool:
        return self.is_healthy

    @property
    def full(self) -> bool:
        return self.max_pending is not None and len(self._running) >= self.max_pending

    @property
    def limits(self) -> RequestLimits:
        return self.config.limits

    @property
    def pooler(self) -> None:
        return None  # a generating model

    def submit_all(self, requests: Sequence[GenerateRequest]) -> list[Mailbox]:
        """Admitted as a whole, with the real admission rules (as ingest's)."""
        error = check_admission(
            requests,
            self.limits,
            self._max_model_len,
            max_choices=self.max_choices,
            max_prompts=self.max_prompts,
        )
        if error is not None:
            raise RequestFailed(error)
        if self.max_pending is not None and len(self._running) + len(requests) > self.max_pending:
            raise Overloaded(retry_after=2.5)
        return [self.submit(request) for request in requests]

    def submit(self, request: GenerateRequest) -> Mailbox:
        if self._task_group is None:
            raise RuntimeError("FakeEngine used outside `async with`")
        if self.max_pending is not None and len(self._running) >= self.max_pending:
            raise Overloaded(retry_after=2.5)
        self.submitted.append(request)
        self._requests_total.inc()
        mailbox = Mailbox(request.request_id, max(1, request.params.n))
        scope = anyio.CancelScope()
        self._running[request.request_id] = scope
        self._task_group.start_soon(self._run, request, mailbox, scope)
        return mailbox

    def abort(self, request_id: str) -> None:
        scope = self._running.pop(request_id, None)
        if scope is not None:
            self.aborted.append(request_id)
            scope.cancel()

    # -- lifecycle ------------------------------------------------------------------
    async def __aenter__(self) -> FakeEngine:
        self._tg_cm = anyio.create_task_group()
        self._task_group = await self._tg_cm.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task_group is not None
        self._task_group.cancel_scope.cancel()
        await self._tg_cm.__aexit__(None, None, None)
        self._task_group = None

    # -- the "graph" ----------------------------------------------------------------
    def _error(self, request: GenerateRequest, message: str, **kw: Any) -> RequestError:
        return RequestError(request_id=request.request_id, message=message, **kw)

    def _tokenize(self, request: GenerateRequest) -> tuple[tuple[int, ...], str] | RequestError:
        tok = self._tokenizer
        if request.prompt_token_ids is not None:
            ids = request.prompt_token_ids
            if max(ids) >= len(tok):
                return self._error(
                    request, f"Token id {max(ids)} is out of vocabulary", param="prompt"
                )
            return ids, tok.decode(list(ids))
        if request.prompt is not None:
            return tuple(tok.encode(request.prompt)), request.prompt
        messages = [{"role": m.role, "content": m.content} for m in request.messages or ()]
        template = request.chat_template
        if template is None and not getattr(tok, "chat_template", None):
            return self._error(request, "The model has no chat template.", param="messages")
        try:
            text = render_chat(
                tok,
                messages,
                template=template,
                add_generation_prompt=request.add_generation_prompt,
                template_kwargs=request.chat_template_kwargs,
                budget=self.template_budget if template is not None else None,
            )
        except ChatTemplateError as e:
            return self._error(request, e.message, param=e.param, code=e.code)
        return tuple(tok.encode(text, add_special_tokens=False)), text

    async def _run(self, request: GenerateRequest, mailbox: Mailbox, scope: Any) -> None:
        with scope:
            try:
                await self._generate(request, mailbox)
            finally:
                if self._running.pop(request.request_id, None) is not None:
                    self.completed.append(request.request_id)

    async def _generate(self, request: GenerateRequest, mailbox: Mailbox) -> None:
        await anyio.sleep(0)
        error = validate_request(request, self.config, MODEL, len(self._tokenizer))
        if error is not None:
            mailbox.fail(error)
            return
        tokenized = self._tokenize(request)
        if isinstance(tokenized, RequestError):
            mailbox.fail(tokenized)
            return
        prompt_ids, prompt_text = tokenized
        params = request.params
        max_tokens, error = check_context_length(
            request.request_id, len(prompt_ids), params.max_tokens, self._max_model_len
        )
        if error is not None:
            mailbox.fail(error)
            return
        vocab = len(self._tokenizer)
        prompt_lps: tuple[TokenLogprobs | None, ...] = ()
        if params.prompt_logprobs is not None:
            prompt_lps = (
                None,
                *(
                    TokenLogprobs(
                        t,
                        prompt_logprob(j),
                        1,
                        top_entries(t, prompt_logprob(j), params.prompt_logprobs, vocab),
                    )
                    for j, t in enumerate(prompt_ids)
                    if j > 0
                ),
            )
        live = set(range(params.n))
        for step in range(max_tokens):
            if self.fail_after is not None and step == self.fail_after:
                mailbox.fail(
                    self._error(
                        request, "The engine failed.", kind="internal"
                    )
                )
                return
            for choice in sorted(live):
                token = expected_tokens(prompt_ids, step + 1, choice)[-1]
                finish = None
                stop_reason = None
                if token in params.stop_token_ids and step + 1 >= params.min_tokens:
                    finish, stop_reason = "stop", token
                elif step + 1 == max_tokens:
                    finish = "length"
                lp = gen_logprob(step, choice)
                logprobs = ()
                if params.logprobs is not None:
                    logprobs = (
                        TokenLogprobs(token, lp, 1, top_entries(token, lp, params.logprobs, vocab)),
                    )
                first = step == 0
                mailbox.put(
                    Chunk(
                        request_id=request.request_id,
                        index=choice,
                        text=self._tokenizer.decode([token]),
                        token_ids=(token,),
                        logprobs=logprobs,
                        finish_reason=finish,
                        stop_reason=stop_reason,
                        num_prompt_tokens=len(prompt_ids),
                        num_output_tokens=step + 1,
                        prompt_text=prompt_text if first and request.echo else None,
                        prompt_token_ids=prompt_ids if first else (),
                        prompt_logprobs=prompt_lps if first else (),
                    )
                )
                if finish is not None:
                    live.discard(choice)
            if not live:
                return
            await anyio.sleep(self.token_delay)


def factory(engine: FakeEngine) -> Callable[[], FakeEngine]:
    """An engine_factory for create_app that hands out this engine."""
    return lambda: engine


def make_app(engine: FakeEngine, **kwargs: Any) -> Litestar:
    """The real app over `engine`, serving it as MODEL with CHAT_TEMPLATE by default."""
    kwargs.setdefault("served_model_name", MODEL)
    kwargs.setdefault("chat_template", CHAT_TEMPLATE)
    return create_app(factory(engine), **kwargs)


def sse_events(text: str) -> list[Any]:
    """The JSON payloads of an SSE body; checks the framing and the final [DONE]."""
    assert text.endswith("data: [DONE]\n\n")
    blocks = text.split("\n\n")
    assert blocks[-1] == ""
    payloads = []
    for block in blocks[:-2]:
        assert block.startswith("data: "), block
        payloads.append(msgspec.json.decode(block[len("data: ") :]))
    return payloads
