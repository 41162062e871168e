"""What GPT-2 and Llama share as step models: a step is `embed`, then `forward_layers` over
every row, then `compute_logits` on the rows asked for (the runner calls the three apart, so
that a decode step's layers can be replayed: `flowllm.models.step_plans`).

Both hand each layer's output and the residual stream to the next norm, which adds them
(vLLM's layout), so the last residual add and the final norm run in `compute_logits`, on
the logit rows only.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch
from torch import nn

from flowllm.models.context import AttentionContext
from flowllm.models.layers import Linear, ResidualNorm

KVCache = tuple[torch.Tensor, torch.Tensor]


class PagedCausalLM(nn.Module, abc.ABC):
    """A causal LM on flattened token batches and a paged KV cache; `forward` returns logits
    only for `ctx.logits_indices`."""

    lm_head: Linear
    dtype: torch.dtype  # the activations' (and float weights')
    device: torch.device
    max_position_embeddings: int  # the longest context the model was trained for
    vocab_size: int  # the width of its logits rows
    # "int8": `load_weights` quantizes the float linear layers (see layers.pack_linears)
    quantization: str | None = None

    @property
    @abc.abstractmethod
    def final_norm(self) -> ResidualNorm:
        """The norm before the LM head."""

    def limit_context(self, max_model_len: int) -> None:
        """The engine serves sequences of up to `max_model_len` tokens (a model whose
        positions depend on the context served adapts to it)."""

    @abc.abstractmethod
    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The rows' input embeddings [n, d]."""

    @abc.abstractmethod
    def forward_layers(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[KVCache],
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, ...]:
        """Every layer over all n rows: (last layer's output, residual stream before it),
        or (h,) without layers. Their K/V go to the cache."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[KVCache],
        ctx: AttentionContext,
    ) -> torch.Tensor:
        # input_ids, positions: [n] -> logits [len(ctx.logits_indices), vocab]
        h = self.embed(input_ids, positions)
        return self.compute_logits(self.forward_layers(h, positions, kv_caches, ctx), ctx)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[KVCache],
        ctx: AttentionContext,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final norm's output [n, d] of every row (what a pooler reads: a decoder
        served as an embedder). A decoder has no token types: `token_type_ids` must be
        None."""
        if token_type_ids is not None:
            raise ValueError("a decoder takes no token types (a cross-encoder pair)")
        hidden = self.forward_layers(self.embed(input_ids, positions), positions, kv_caches, ctx)
        if len(hidden) == 1:  # no layers
            normed: torch.Tensor = self.final_norm(hidden[0])
            return normed
        return self.final_norm.add_and_norm(hidden[0], hidden[1])[0]

    def drop_lm_head(self) -> None:
        """Free the LM head's weight: a model served for pooling computes no logits (its
        embedding keeps its own table, `pack_linears` saw to that)."""
        self.lm_head = Linear(self.lm_head.in_features, 0, False, self.dtype, self.device)

    def compute_logits(
        self, hidden: tuple[torch.Tensor, ...], ctx: AttentionContext
    ) -> torch.Tensor:
        """Logits [len(ctx.logits_indices), vocab] of `forward_layers`' rows: the last
        residual add and norm run on those rows only."""
        h = hidden[0].index_select(0, ctx.logits_indices)
        if len(hidden) == 1:  # no layers
            h = self.final_norm(h)
        else:
            h, _ = self.final_norm.add_and_norm(h, hidden[1].index_select(0, ctx.logits_indices))
        logits: torch.Tensor = self.lm_head(h)
        return logits
