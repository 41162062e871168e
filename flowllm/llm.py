"""The offline API: `LLM(model).generate(prompts, params)` through the same stage graph.

The model, tokenizer and KV cache load once, in the constructor; each `generate` call runs
the graph on its own event loop for the duration of the call, submitting every prompt at
once so continuous batching does the rest. A model served for pooling (`task="embed"` or
`"score"`, or what `auto` reads from the checkpoint) runs the pooling graph: `embed` and
`score` instead of `generate`.

With `multiprocess=True` the graph runs as it is placed (flowllm/engine/default.yaml): the
model and the step loop in an engine core process that the constructor starts, the
per-request stages here, as a server's front runs them.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import anyio
import msgspec

from flowllm.config import EngineConfig, engine_config
from flowllm.engine import graph_for_task
from flowllm.engine.async_engine import AsyncEngine
from flowllm.engine.core import CoreSpec, ServicesBuilder, placement_of, start_core
from flowllm.engine.front import FrontEngine
from flowllm.engine.loading import build_services
from flowllm.engine.scoring import pair_texts, plan_scores, pooling_request, vector_of
from flowllm.graph.validator import ValidGraph, load_graph
from flowllm.mailbox import Mailbox
from flowllm.messages import (
    ChatMessage,
    Chunk,
    GenerateRequest,
    PoolingParams,
    SamplingParams,
    TokenLogprobs,
    ToolCall,
    merge_by_choice,
)
from flowllm.models.loader import resolve_model
from flowllm.models.pooler_config import resolve_task
from flowllm.models.tokenizer import load_tokenizer, tokenizer_source
from flowllm.stages.services import EngineServices

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class CompletionOutput(msgspec.Struct, kw_only=True):
    """One generated choice."""

    index: int
    text: str = ""
    token_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class RequestOutput(msgspec.Struct, kw_only=True):
    """Everything one prompt produced."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprobs | None] | None
    outputs: list[CompletionOutput]

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


class EmbeddingOutput(msgspec.Struct, kw_only=True):
    embedding: list[float]


class EmbeddingRequestOutput(msgspec.Struct, kw_only=True):
    """One prompt's embedding (vLLM's shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


class ScoringOutput(msgspec.Struct, kw_only=True):
    score: float


class ScoringRequestOutput(msgspec.Struct, kw_only=True):
    """One pair's score (vLLM's shape): with an embedding model, `prompt_token_ids` are
    the two texts' one after the other."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True


Prompt = str | Sequence[int]
T = TypeVar("T")


class LLM:
    """An engine for offline batch generation.

    Keyword arguments are the engine settings by their CLI names without dashes
    (`dtype`, `max_model_len`, `block_size`, `kv_cache_memory`, `max_num_seqs`,
    `max_num_batched_tokens`, `enable_prefix_caching`, `seed`, ...), or pass `config`.
    `graph` runs another graph YAML; `services` reuses an already loaded model.
    `trace_dir` records each `generate` call's channel traffic there (the latest call's
    replaces the previous one), limited to `trace_channels` and `trace_max_bytes`.
    `multiprocess=True` runs the model in an engine core process of its own (a graph
    placed in processes, as the default one; `close()` stops it); `core_services`, a
    picklable `build(config, tokenizer_now=False)`, then makes that process's services in
    place of loading `model` (a benchmark's stand-in model; the front's tokenizer is
    `config`'s). Without `graph`, the graph is the one of the model's task (`task=`,
    default `auto`).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        config: EngineConfig | None = None,
        graph: ValidGraph | str | Path | None = None,
        services: EngineServices | None = None,
        trace_dir: str | Path | None = None,
        trace_channels: Sequence[str] | None = None,
        trace_max_bytes: int | None = None,
        multiprocess: bool = False,
        core_services: ServicesBuilder | None = None,
        **settings: Any,
    ) -> None:
        self._core: CoreRun | None = None
        if multiprocess:
            if services is not None:
                raise TypeError("multiprocess loads the model in its own process, not services")
            if trace_dir is not None:
                raise TypeError("a trace records a graph run in one process: not multiprocess")
            if config is None:
                config = engine_config(model, **settings)
            elif model is not None or settings:
                raise TypeError("pass either config or model and settings, not both")
            if core_services is None:
                config = _with_served_task(config)
            graph = graph or graph_for_task(config.model.task, config.speculative is not None)
            self._core = CoreRun.start(config, graph, core_services)
            graph = self._core.graph
            services = self._core.front_services()
        elif core_services is not None:
            raise TypeError("core_services makes an engine core process's: multiprocess=True")
        elif services is not None:
            if model is not None or config is not None or settings:
                raise TypeError("services already hold the model and its config")
        else:
            if config is None:
                config = engine_config(model, **settings)
            elif model is not None or settings:
                raise TypeError("pass either config or model and settings, not both")
            services = build_services(config)
        self.config = services.config
        task = services.pooler.task if services.pooler is not None else "generate"
        graph = graph or graph_for_task(task, self.config.speculative is not None)
        # loaded and checked once: every generate call runs it
        self.graph = graph if isinstance(graph, ValidGraph) else load_graph(graph)
        self.services = services
        self.trace_dir = trace_dir
        self.trace_channels = trace_channels
        self.trace_max_bytes = trace_max_bytes
        self._ids = itertools.count()
        self.last_run: EngineServices | None = None  # the latest generate's (for its metrics)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.services.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order."""
        prompt_list = _prompt_list(prompts)
        params_list = _params_per_input(sampling_params, len(prompt_list), "prompt")
        requests = [self._request(p, sp) for p, sp in zip(prompt_list, params_list, strict=True)]
        return anyio.run(self._run, requests, _collect)

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate for one conversation (OpenAI-style message dicts) or several.

        `chat_template_kwargs`: extra template variables (e.g. `{"enable_thinking": False}`
        for Qwen3), within the request limits.

        `tools` (OpenAI's `{"type": "function", "function": {...}}` entries) are rendered
        by the chat template, or by the fallback system prompt for a template that ignores
        them (docs/structured-output.md); assistant turns may carry `tool_calls` and
        `tool` turns a `tool_call_id`. The output is the model's text: constrain it with
        `SamplingParams(structured_outputs=...)` to have it call a tool.
        """
        Conversation = Sequence[dict[str, Any]]
        conversations = (
            [cast(Conversation, messages)]
            if messages and isinstance(messages[0], dict)
            else list(cast(Sequence[Conversation], messages))
        )
        params_list = _params_per_input(sampling_params, len(conversations), "conversation")
        requests = [
            GenerateRequest(
                request_id=f"offline-{next(self._ids)}",
                model=self.services.served_model_name,
                params=params,
                arrival_time=time.monotonic(),
                messages=tuple(chat_message(m) for m in conversation),
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs or None,
                tools=tuple(tools) if tools else None,
            )
            for conversation, params in zip(conversations, params_list, strict=True)
        ]
        return anyio.run(self._run, requests, _collect)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """The embedding of every prompt (text or token ids), in prompt order: a model
        served for the `embed` task. `pooling_params`: `dimensions` (Matryoshka models),
        `normalize`."""
        requests = [
            pooling_request(
                f"offline-{next(self._ids)}",
                self.services.served_model_name,
                p if isinstance(p, str) else tuple(int(i) for i in p),
                time.monotonic(),
                pooling_params,
            )
            for p in _prompt_list(prompts)
        ]
        chunks = anyio.run(self._run, requests, _pooled)
        return [
            EmbeddingRequestOutput(
                request_id=request.request_id,
                prompt_token_ids=list(chunk.prompt_token_ids),
                outputs=EmbeddingOutput(embedding=vector_of(chunk).tolist()),
            )
            for request, chunk in zip(requests, chunks, strict=True)
        ]

    def score(
        self, text_1: str | Sequence[str], text_2: str | Sequence[str]
    ) -> list[ScoringRequestOutput]:
        """The score of each pair (one text_1 against each text_2, or the two lists index
        by index): a cross-encoder's relevance (task `score`), or an embedding model's
        cosine similarity (task `embed`), as vLLM's."""
        pooler = self.services.pooler
        plan = plan_scores(
            pair_texts(text_1, text_2),
            cross_encoder=pooler is not None and pooler.task == "score",
            request_id=f"offline-{next(self._ids)}",
            model=self.services.served_model_name,
            arrival_time=time.monotonic(),
        )
        chunks = anyio.run(self._run, plan.requests, _pooled)
        scores = plan.scores([vector_of(chunk) for chunk in chunks])
        return [
            ScoringRequestOutput(
                request_id="_".join(plan.requests[k].request_id for k in members),
                prompt_token_ids=[t for k in members for t in chunks[k].prompt_token_ids],
                outputs=ScoringOutput(score=score),
            )
            for members, score in zip(plan.pairs, scores, strict=True)
        ]

    def _request(self, prompt: Prompt, params: SamplingParams) -> GenerateRequest:
        text = prompt if isinstance(prompt, str) else None
        ids = None if isinstance(prompt, str) else tuple(int(i) for i in prompt)
        return GenerateRequest(
            request_id=f"offline-{next(self._ids)}",
            model=self.services.served_model_name,
            params=params,
            arrival_time=time.monotonic(),
            prompt=text,
            prompt_token_ids=ids,
            echo=text is not None,  # keeps the prompt text on the output
        )

    async def _run(
        self,
        requests: list[GenerateRequest],
        collect: Callable[[Mailbox, GenerateRequest], Awaitable[T]],
    ) -> list[T]:
        services = self.services.fresh()
        recorder = None
        if self.trace_dir is not None:
            from flowllm.traces.recorder import TraceRecorder

            recorder = TraceRecorder(
                self.trace_dir, channels=self.trace_channels, max_bytes=self.trace_max_bytes
            )
        if self._core is not None:
            running = self._core.engine(services.tokenizer, recorder, derived_from=services)
        else:
            running = AsyncEngine.start(graph=self.graph, services=services, recorder=recorder)
        async with running as engine:
            self.last_run = engine.services  # a front's own, when the core is elsewhere
            boxes = [await engine.submit_when_admitted(request) for request in requests]
            # One reader, mailbox after mailbox: the mailboxes not being read merge their
            # chunks without waking anyone, so a step costs one wakeup here, not one per
            # running request (the graph never waits for a reader).
            pairs = zip(boxes, requests, strict=True)
            return [await collect(box, request) for box, request in pairs]

    def close(self) -> None:
        """Stop the engine core process (multiprocess); the LLM cannot generate after."""
        if self._core is not None:
            self._core.stop()


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text or token ids) or several, as a list."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [cast(Prompt, prompts)]
    return list(cast(Sequence[Prompt], prompts))


def _with_served_task(config: EngineConfig) -> EngineConfig:
    """`config` with its task resolved from the checkpoint (the core's graph follows it)."""
    resolved = resolve_model(config.model.model, config.model.quantization)
    task = resolve_task(resolved.path, config.model.task, from_gguf=resolved.config_from_gguf)
    return msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, task=task))


class CoreRun:
    """The engine core process behind a multiprocess `LLM`, and how its front connects."""

    def __init__(
        self,
        config: EngineConfig,
        graph: ValidGraph,
        folder: str,
        build: ServicesBuilder | None = None,
    ) -> None:
        self.config = config
        self.graph = graph
        self.folder = folder
        self.spec = CoreSpec(
            config=config,
            graph_file=graph.spec.source,
            address=os.path.join(folder, "core.sock"),
            fronts=1,
        )
        self.process = start_core(self.spec, build)
        weakref.finalize(self, _stop_core, self.process, folder)

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        graph: ValidGraph | str | Path,
        build: ServicesBuilder | None = None,
    ) -> CoreRun:
        valid = graph if isinstance(graph, ValidGraph) else load_graph(graph)
        if not valid.placement:
            raise ValueError(
                f"graph {valid.name!r} names no processes: multiprocess needs a placed graph"
            )
        placement_of(valid)  # a front and one core, or say why not
        if build is None:
            resolve_model(config.model.model, config.model.quantization)  # convert once, here
        return cls(config, valid, tempfile.mkdtemp(prefix="flowllm-"), build)

    def front_services(self) -> EngineServices:
        """The front's services: the tokenizer (loaded here while the core loads the model)
        and the model's facts from the core."""
        tokenizer = load_tokenizer(*tokenizer_source(self.config))

        async def connect() -> EngineServices:
            async with self.engine(tokenizer, None) as engine:
                services: EngineServices = engine.services
                return services

        return anyio.run(connect)

    def engine(
        self,
        tokenizer: PreTrainedTokenizerBase,
        recorder: Any,
        derived_from: EngineServices | None = None,
    ) -> Any:
        """A front connected to the core (`derived_from`: an earlier front's services, whose
        tokenizer tables it reuses)."""
        return FrontEngine.connect(
            self.config,
            self.graph,
            self.spec.address,
            tokenizer=tokenizer,
            derived_from=derived_from,
            recorder=recorder,
        )

    def stop(self) -> None:
        _stop_core(self.process, self.folder)


def _stop_core(process: Any, folder: str) -> None:
    if process.is_alive():
        process.terminate()
        process.join(10)
        if process.is_alive():
            process.kill()
    shutil.rmtree(folder, ignore_errors=True)


def _params_per_input(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int, what: str
) -> list[SamplingParams]:
    """One SamplingParams per prompt or conversation, each checked against its declared
    field types (a list where a tuple is declared becomes one). A SamplingParams is not
    checked when built: a wrong type (`stop=None`) would fail inside the graph, for every
    request of the call."""
    if sampling_params is None:
        sampling_params = SamplingParams()
    params_list = (
        [sampling_params] * count
        if isinstance(sampling_params, SamplingParams)
        else list(sampling_params)
    )
    if len(params_list) != count:
        raise ValueError(f"give one SamplingParams, or one per {what}")
    try:
        return [msgspec.convert(msgspec.to_builtins(p), SamplingParams) for p in params_list]
    except (msgspec.ValidationError, TypeError) as e:
        raise TypeError(f"invalid SamplingParams: {e}") from None


def chat_message(message: dict[str, Any]) -> ChatMessage:
    """An OpenAI-style message dict as a ChatMessage (content parts: text only)."""
    content = message.get("content") or ""
    if not isinstance(content, str):
        content = "\n".join(part["text"] for part in content if part.get("type") == "text")
    calls = tuple(
        ToolCall(
            id=call.get("id") or f"call_{i}",
            name=call["function"]["name"],
            arguments=(
                arguments
                if isinstance(arguments := call["function"].get("arguments", "{}"), str)
                else json.dumps(arguments)
            ),
        )
        for i, call in enumerate(message.get("tool_calls") or ())
    )
    return ChatMessage(message["role"], content, calls, message.get("tool_call_id"))


async def _pooled(box: Mailbox, request: GenerateRequest) -> Chunk:
    """A pooling request's one chunk, its vector in `pooled` (errors raise RequestFailed)."""
    return merge_by_choice([chunk async for chunk in box])[0]


async def _collect(box: Mailbox, request: GenerateRequest) -> RequestOutput:
    """Read a request's mailbox to its end (errors raise RequestFailed)."""
    choices = [CompletionOutput(index=i) for i in range(request.params.n)]
    result = RequestOutput(
        request_id=request.request_id,
        prompt=request.prompt,
        prompt_token_ids=list(request.prompt_token_ids or ()),
        prompt_logprobs=None,
        outputs=choices,
    )
    want_logprobs = request.params.logprobs is not None
    for index, chunk in merge_by_choice([chunk async for chunk in box]).items():
        if chunk.prompt_token_ids:
            result.prompt_token_ids = list(chunk.prompt_token_ids)
            if request.params.prompt_logprobs is not None:
                result.prompt_logprobs = list(chunk.prompt_logprobs)
        out = choices[index]
        out.text = chunk.text
        out.token_ids = list(chunk.token_ids)
        out.logprobs = list(chunk.logprobs) if want_logprobs else None
        out.finish_reason = chunk.finish_reason
        out.stop_reason = chunk.stop_reason
    return result
