"""Embedding, score and rerank requests as the pooling graph's requests, and their vectors
as OpenAI's embeddings, vLLM's scores and the rerank results of vLLM, Jina and Cohere.

Every client value is bounded before anything is built for it: the inputs, pairs and
documents against `max_prompts_per_request` (each one a request in the graph), here;
`dimensions` and token ids by the graph's validate stage, each input's length by tokenize
(400s naming the field). An endpoint the served task does not serve is a 400 naming the
task (`require_task`), as is text generation from a model served for pooling.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

import msgspec

from flowllm.api.convert import split_prompts
from flowllm.api.errors import ApiError
from flowllm.api.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingUsage,
    RerankedDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreResponse,
)
from flowllm.config import RequestLimits
from flowllm.engine.scoring import (
    PairError,
    ScorePlan,
    pair_texts,
    plan_scores,
    pooling_request,
    vector_of,
)
from flowllm.messages import Chunk, GenerateRequest, PoolingParams
from flowllm.models.pooler_config import PoolerConfig


def require_task(pooler: PoolerConfig | None, endpoint: str, *tasks: str) -> None:
    """A 400 naming the served task when `endpoint` needs one of `tasks`."""
    served = "generate" if pooler is None else pooler.task
    if served in tasks:
        return
    wanted = " or ".join(f"--task {task}" for task in tasks)
    raise ApiError(
        f"This model is served for the '{served}' task: {endpoint} needs a model served "
        f"with {wanted}.",
        param="model",
        code="unsupported_task",
    )


def _bounded(count: int, limits: RequestLimits, param: str, what: str) -> None:
    limit = limits.max_prompts_per_request
    if count > limit:
        raise ApiError(
            f"Invalid '{param}': too many {what}. Expected at most {limit}, but got {count}.",
            param=param,
            code="array_above_max_length",
        )


def _usage(chunks: Sequence[Chunk]) -> PoolingUsage:
    tokens = sum(chunk.num_prompt_tokens for chunk in chunks)
    return PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)


def prepare_embeddings(
    body: EmbeddingRequest,
    *,
    request_id: str,
    model: str,
    arrival_time: float,
    limits: RequestLimits,
) -> list[GenerateRequest]:
    """One graph request per input (a string, strings, token ids or id lists)."""
    prompts = split_prompts(body.input, "input")
    _bounded(len(prompts), limits, "input", "inputs")
    for prompt in prompts:
        if not prompt:
            empty = "string" if isinstance(prompt, str) else "array"
            raise ApiError(
                f"Invalid 'input': an input cannot be an empty {empty}.",
                param="input",
                code=f"empty_{empty}",
            )
    pooling = PoolingParams(dimensions=body.dimensions, normalize=body.normalize)
    return [
        pooling_request(f"{request_id}-{i}", model, prompt, arrival_time, pooling)
        for i, prompt in enumerate(prompts)
    ]


def embedding_response(
    chunks: Sequence[Chunk], *, encode_base64: bool, response_id: str, created: int, model: str
) -> EmbeddingResponse:
    """OpenAI's embeddings body: base64 is the vector's float32 little-endian bytes, as
    the openai SDK decodes it."""
    data = [
        EmbeddingData(
            index=i,
            embedding=(
                base64.b64encode(chunk.pooled).decode("ascii")
                if encode_base64
                else vector_of(chunk).tolist()
            ),
        )
        for i, chunk in enumerate(chunks)
    ]
    return EmbeddingResponse(
        id=response_id, created=created, model=model, data=data, usage=_usage(chunks)
    )


def prepare_scores(
    text_1: str | list[str],
    text_2: str | list[str],
    pooler: PoolerConfig | None,
    *,
    request_id: str,
    model: str,
    arrival_time: float,
    limits: RequestLimits,
    names: tuple[str, str] = ("text_1", "text_2"),
) -> ScorePlan:
    """The graph requests that score the pairs of `text_1` and `text_2`, fields the
    client calls `names` (rerank's query and documents)."""
    for name, side in zip(names, (text_1, text_2), strict=True):
        if not isinstance(side, str):
            _bounded(len(side), limits, name, "texts")
    try:
        pairs = pair_texts(text_1, text_2)
    except PairError as e:
        param = names[("text_1", "text_2").index(e.param)]
        raise ApiError(str(e).replace(e.param, param), param=param) from e
    plan = plan_scores(
        pairs,
        cross_encoder=pooler is not None and pooler.task == "score",
        request_id=request_id,
        model=model,
        arrival_time=arrival_time,
    )
    _bounded(len(plan.requests), limits, names[1], "distinct texts to embed")
    return plan


def score_response(
    plan: ScorePlan, chunks: Sequence[Chunk], *, response_id: str, created: int, model: str
) -> ScoreResponse:
    scores = plan.scores([vector_of(chunk) for chunk in chunks])
    return ScoreResponse(
        id=response_id,
        created=created,
        model=model,
        data=[ScoreData(index=i, score=score) for i, score in enumerate(scores)],
        usage=_usage(chunks),
    )


def rerank_documents(body: RerankRequest) -> list[str]:
    """The documents' texts (strings, or objects with a `text`)."""
    if body.top_n is not None and body.top_n < 0:
        raise ApiError(
            f"Invalid 'top_n': expected a value >= 0, but got {body.top_n}.",
            param="top_n",
            code="integer_below_min_value",
        )
    if not body.documents:
        raise ApiError(
            "Invalid 'documents': expected at least one document.",
            param="documents",
            code="empty_array",
        )
    return [doc if isinstance(doc, str) else doc.text for doc in body.documents]


def rerank_response(
    body: RerankRequest,
    documents: list[str],
    plan: ScorePlan,
    chunks: Sequence[Chunk],
    *,
    response_id: str,
    model: str,
) -> RerankResponse:
    """The documents by relevance, best first (ties in request order), the best `top_n`."""
    scores = plan.scores([vector_of(chunk) for chunk in chunks])
    order = sorted(range(len(documents)), key=lambda i: -scores[i])
    if body.top_n:
        order = order[: body.top_n]
    keep = body.return_documents is not False
    results = [
        RerankResult(
            index=i,
            relevance_score=scores[i],
            document=RerankedDocument(text=documents[i]) if keep else msgspec.UNSET,
        )
        for i in order
    ]
    return RerankResponse(id=response_id, model=model, usage=_usage(chunks), results=results)
