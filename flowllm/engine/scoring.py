"""Pooling requests and what their vectors mean, shared by the HTTP API (/v1/embeddings,
/v1/score, /v1/rerank) and the offline `LLM.embed` and `LLM.score`.

Scores of text pairs, as vLLM makes them: a cross-encoder reads each pair as one prompt
(the two texts joined by its tokenizer) and its pooled value is the score; an embedding
model embeds each distinct text once and a pair's score is the cosine similarity of its
two vectors. Pairs follow vLLM's rules: one text against one, one against each of a list,
or two lists of equal length, index by index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flowllm.messages import Chunk, GenerateRequest, PoolingParams, SamplingParams

# A pooling request generates nothing: one step, which pool ends.
POOLING_SAMPLING = SamplingParams(max_tokens=1)

Prompt = str | tuple[int, ...]


class PairError(ValueError):
    """The two sides of a score request do not pair up; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def pair_texts(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: 1 to 1, 1 to N, or N to N index by index."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if not firsts:
        raise PairError("Invalid 'text_1': expected at least one text.", "text_1")
    if not seconds:
        raise PairError("Invalid 'text_2': expected at least one text.", "text_2")
    if len(firsts) == 1:
        return [(firsts[0], second) for second in seconds]
    if len(firsts) != len(seconds):
        raise PairError(
            f"Invalid 'text_2': text_1 has {len(firsts)} texts and text_2 {len(seconds)}; "
            "give one text_1, or as many as text_2.",
            "text_2",
        )
    return list(zip(firsts, seconds, strict=True))


def pooling_request(
    request_id: str,
    model: str,
    prompt: Prompt,
    arrival_time: float,
    pooling: PoolingParams | None = None,
    text_pair: str | None = None,
) -> GenerateRequest:
    """A request for `prompt`'s vector (text or token ids; with `text_pair`, a
    cross-encoder's pair)."""
    return GenerateRequest(
        request_id=request_id,
        model=model,
        params=POOLING_SAMPLING,
        arrival_time=arrival_time,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=None if isinstance(prompt, str) else prompt,
        pooling=pooling or PoolingParams(),
        text_pair=text_pair,
    )


def vector_of(chunk: Chunk) -> np.ndarray:
    """A pooling request's vector, float32, from its chunk."""
    return np.frombuffer(chunk.pooled, dtype="<f4")


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity, in float32 as torch's `cosine_similarity` (eps 1e-8)."""
    norms = max(float(np.linalg.norm(a)), 1e-8) * max(float(np.linalg.norm(b)), 1e-8)
    return float(np.dot(a, b)) / norms


@dataclass(frozen=True)
class ScorePlan:
    """The requests that score some pairs, and which of them each pair reads: its own
    (a cross-encoder's pair), or its two texts' (an embedding model's)."""

    requests: list[GenerateRequest]
    pairs: list[tuple[int, ...]]

    def scores(self, vectors: Sequence[np.ndarray]) -> list[float]:
        """Each pair's score from the requests' vectors (in request order)."""
        return [
            float(vectors[p[0]][0]) if len(p) == 1 else cosine(vectors[p[0]], vectors[p[1]])
            for p in self.pairs
        ]


def plan_scores(
    pairs: Sequence[tuple[str, str]],
    *,
    cross_encoder: bool,
    request_id: str,
    model: str,
    arrival_time: float,
) -> ScorePlan:
    """The requests that score `pairs`: one per pair for a cross-encoder, one per distinct
    text for an embedding model; request ids are `request_id-k`."""

    def request(k: int, prompt: str, pair: str | None = None) -> GenerateRequest:
        return pooling_request(f"{request_id}-{k}", model, prompt, arrival_time, None, pair)

    if cross_encoder:
        requests = [request(k, first, second) for k, (first, second) in enumerate(pairs)]
        return ScorePlan(requests, [(k,) for k in range(len(pairs))])
    texts = list(dict.fromkeys(text for pair in pairs for text in pair))
    index = {text: k for k, text in enumerate(texts)}
    requests = [request(k, text) for k, text in enumerate(texts)]
    return ScorePlan(requests, [(index[first], index[second]) for first, second in pairs])
