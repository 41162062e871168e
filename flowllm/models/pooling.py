"""A pooler: the hidden states of a prompt's rows -> its vector (the pool stage's work).

An embedding is the [CLS] (first) row, the mean of every row, or the last row, in float32;
a request's `dimensions` keep its first values (Matryoshka), then it is L2-normalized
unless the request or the model says otherwise: truncation before normalization, as vLLM
does, so a shortened vector has unit length too. A cross-encoder's score is its
classifier's logit of the [CLS] row, through the model's activation (sentence-transformers'
CrossEncoder: a sigmoid unless the checkpoint names another).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from flowllm.messages import PoolingParams
from flowllm.models.pooler_config import PoolerConfig


class Classifier(Protocol):
    def classify(self, first_rows: torch.Tensor) -> torch.Tensor: ...


class Pooler:
    """Pools the finished prompts of one step."""

    def __init__(self, config: PoolerConfig, model: Classifier | None = None) -> None:
        if config.task == "score" and model is None:
            raise ValueError("a scoring pooler needs the model's classifier")
        self.config = config
        self.model = model

    def rows(self, hidden: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """One prompt's pooled row [d] (float32) from its rows hidden[start:end]."""
        pooling = self.config.pooling
        if pooling == "cls":
            return hidden[start].float()
        if pooling == "last":
            return hidden[end - 1].float()
        return hidden[start:end].float().mean(0)

    def __call__(
        self,
        hidden: torch.Tensor,
        spans: Sequence[tuple[int, int]],
        params: Sequence[PoolingParams | None],
    ) -> list[torch.Tensor]:
        """The vectors (float32, 1-D) of the prompts whose rows are `spans` of `hidden`
        [num_tokens, d], each as its `params` ask."""
        if not spans:
            return []
        if self.config.task == "score":
            assert self.model is not None
            first = torch.stack([hidden[start] for start, _ in spans])
            scores = list(self.model.classify(first).float().unbind(0))
            if self.config.activation == "sigmoid":
                # prompt by prompt: torch's sigmoid takes its vector formula or its scalar
                # one by an element's place in the tensor, which differ in the last bit
                scores = [score.sigmoid() for score in scores]
            return scores
        vectors: list[torch.Tensor] = []
        for (start, end), asked in zip(spans, params, strict=True):
            row = self.rows(hidden, start, end)
            asked = asked or PoolingParams()
            if asked.dimensions is not None:
                row = row[: asked.dimensions]
            normalize = self.config.normalize if asked.normalize is None else asked.normalize
            vectors.append(F.normalize(row, p=2, dim=0) if normalize else row)
        return vectors
