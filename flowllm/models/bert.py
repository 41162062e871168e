"""BERT encoders for the pooling graph: `BertModel` (embeddings) and its cross-encoder form
`BertForSequenceClassification` (a relevance score per pair), on flattened steps.

Attention is bidirectional over each prompt, and a step holds every prompt whole (the
pooling graph runs without chunked prefill), so an encoder needs no paged KV cache: each
prompt is computed once and its K/V are never read again. Each sequence attends over its
own rows with torch's `scaled_dot_product_attention`, the sequences of one length batched
into one call: its batch entries are computed apart, so a row's output never depends on
the other prompts of its step (batch invariance); the paged kernels are causal and would
store K/V for nothing.

Post-norm layers: LayerNorm(x + attention(x)), then LayerNorm(h + MLP(h)), each add fused
into its norm where the native kernels serve. Linear layers take `batch_layout`: an
encoder multiplies whole prompts, thousands of rows a step (see `flowllm.models.layers`).
A step runs padded with zero rows up to a row count of `flowllm.models.step_rows`, where
oneDNN sums every row alike, and so does the cross-encoder's head over the step's [CLS]
rows: a prompt's vector or score is then the same bits whatever its company.
Absolute position embeddings only; other options change the model and are refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flowllm.models.context import AttentionContext
from flowllm.models.errors import UnsupportedModelError
from flowllm.models.layers import (
    Embedding,
    LayerNorm,
    Linear,
    WeightMap,
    activation,
    batch_layout,
    check_shape,
    config_get,
    pack_linears,
)
from flowllm.models.pooler_config import num_labels
from flowllm.models.step_rows import StepRows, pad_rows

CROSS_ENCODER = "BertForSequenceClassification"

# Sequences of one length: (length, their rows [sequences * length], sequence by sequence)
LengthGroup = tuple[int, torch.Tensor]


def length_groups(starts: Sequence[int], device: torch.device) -> list[LengthGroup]:
    """The sequences whose rows start at `starts[i]` and end at `starts[i + 1]`, grouped by
    length, each group's rows in one index tensor."""
    by_length: dict[int, list[int]] = {}
    for start, end in pairwise(starts):
        by_length.setdefault(end - start, []).append(start)
    return [
        (length, (torch.tensor(firsts)[:, None] + torch.arange(length)).reshape(-1).to(device))
        for length, firsts in by_length.items()
    ]


class BertLayer(nn.Module):
    """Self-attention -> dense -> LayerNorm(+ input); intermediate -> act -> dense ->
    LayerNorm(+ attention output)."""

    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        d = int(config_get(config, "hidden_size"))
        self.num_heads = int(config_get(config, "num_attention_heads"))
        self.head_dim = d // self.num_heads
        inter = int(config_get(config, "intermediate_size"))
        eps = float(config_get(config, "layer_norm_eps", 1e-12))
        layout = batch_layout(dtype, device)

        def linear(i: int, o: int) -> Linear:
            return Linear(i, o, True, dtype, device, layout=layout)

        self.qkv = linear(d, 3 * d)  # rows: [query | key | value]
        self.attn_out = linear(d, d)
        self.attn_norm = LayerNorm(d, eps, dtype, device)
        self.intermediate = linear(d, inter)
        self.act = activation(str(config_get(config, "hidden_act", "gelu")), "BERT")
        self.output = linear(inter, d)
        self.out_norm = LayerNorm(d, eps, dtype, device)

    def forward(self, h: torch.Tensor, groups: Sequence[LengthGroup]) -> torch.Tensor:
        # h: [n, d], the rows of every sequence, `groups` of them by length
        attn = self.attn_out(self.attend(self.qkv(h), groups))
        h, _ = self.attn_norm.add_and_norm(attn, h)  # the sum is written into the old h
        x = self.output(self.act(self.intermediate(h)))
        out, _ = self.out_norm.add_and_norm(x, h)
        return out

    def attend(self, qkv: torch.Tensor, groups: Sequence[LengthGroup]) -> torch.Tensor:
        """Each sequence's rows attend over its own rows, both ways: [n, d]."""
        n = qkv.shape[0]
        heads, head_dim = self.num_heads, self.head_dim
        fused = qkv.view(n, 3, heads, head_dim)
        out = qkv.new_zeros(n, heads, head_dim)  # a padded step's extra rows stay 0
        for length, rows in groups:
            # [3, sequences, heads, length, head_dim] views of the group's rows
            q, k, v = fused.index_select(0, rows).view(-1, length, 3, heads, head_dim).permute(
                2, 0, 3, 1, 4
            )
            seqs = F.scaled_dot_product_attention(q, k, v)  # [sequences, heads, length, hd]
            out.index_copy_(0, rows, seqs.transpose(1, 2).reshape(-1, heads, head_dim))
        return out.view(n, heads * head_dim)


class BertModel(nn.Module):
    """A BERT encoder: `hidden_states` of every row of a step; the cross-encoder form also
    `classify`s a prompt's [CLS] row."""

    # "int8": `load_weights` quantizes the linear layers (see layers.pack_linears)
    quantization: str | None = None

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        device = torch.device(device)
        _refuse_options(hf_config)
        self.config = hf_config
        self.dtype = dtype
        self.device = device
        d = int(config_get(hf_config, "hidden_size"))
        self.hidden_size = d
        self.vocab_size = int(config_get(hf_config, "vocab_size"))
        self.num_layers = int(config_get(hf_config, "num_hidden_layers"))
        self.max_position_embeddings = int(config_get(hf_config, "max_position_embeddings", 512))
        eps = float(config_get(hf_config, "layer_norm_eps", 1e-12))
        self.word_embeddings = Embedding(self.vocab_size, d, dtype, device)
        self.position_embeddings = Embedding(self.max_position_embeddings, d, dtype, device)
        types = int(config_get(hf_config, "type_vocab_size", 2))
        self.token_type_embeddings = Embedding(types, d, dtype, device)
        self.embeddings_norm = LayerNorm(d, eps, dtype, device)
        self.layers = nn.ModuleList(
            BertLayer(hf_config, dtype, device) for _ in range(self.num_layers)
        )
        archs = config_get(hf_config, "architectures", None) or ()
        self.cross_encoder = CROSS_ENCODER in archs
        # The cross-encoder's head: BERT's pooler (dense + tanh on [CLS]), then the classifier.
        self.pooler: Linear | None = None
        self.classifier: Linear | None = None
        if self.cross_encoder:
            self.pooler = Linear(d, d, True, dtype, device)
            self.classifier = Linear(d, num_labels(hf_config), True, dtype, device)
        self.limit_steps(self.max_position_embeddings, self.max_position_embeddings)

    def limit_steps(self, max_rows: int, max_prompts: int) -> None:
        """Plan for steps of at most `max_rows` rows and `max_prompts` prompts: the row
        counts the encoder and the head pad a step to (`flowllm.models.step_rows`)."""
        linears = [m for m in self.layers.modules() if isinstance(m, Linear)]
        self.steps = StepRows(linears, max_rows)
        self.head_steps = StepRows([m for m in (self.pooler, self.classifier) if m], max_prompts)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: object,
        ctx: AttentionContext,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The last layer's output [n, d] of every row: each sequence (rows
        `ctx.query_start_loc[i]:[i + 1]`, the whole prompt) attends over itself only.
        `kv_caches` is unused: an encoder keeps no cache."""
        # input_ids, positions, token_type_ids: [n] -> [n, d], computed on `rows` >= n rows
        n = input_ids.shape[0]
        rows = self.steps.padded(n)
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        input_ids, positions, types = (pad_rows(t, rows) for t in (input_ids, positions, types))
        h = self.word_embeddings(input_ids) + self.token_type_embeddings(types)
        h = self.embeddings_norm(h + self.position_embeddings(positions))
        groups = length_groups(ctx.query_start_loc.tolist(), input_ids.device)
        for layer in self.layers:
            h = layer(h, groups)
        out: torch.Tensor = h[:n]
        return out

    def classify(self, first_rows: torch.Tensor) -> torch.Tensor:
        """The cross-encoder's logits [m, labels] of prompts' [CLS] rows [m, d]."""
        if self.pooler is None or self.classifier is None:
            raise UnsupportedModelError("this BERT has no classifier head (BertModel)")
        m = first_rows.shape[0]
        x = pad_rows(first_rows, self.head_steps.padded(m))
        logits: torch.Tensor = self.classifier(torch.tanh(self.pooler(x)))
        return logits[:m]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF BERT tensors (prefixed `bert.` or not), fusing query/key/value, then pack
        the linear layers. An embedder ignores the pooler's weights, which it never runs."""
        pooler = frozenset({"pooler.dense.weight", "pooler.dense.bias"})
        unused = frozenset() if self.cross_encoder else pooler
        m = WeightMap(prefixes=("bert.",), ignored_suffixes=(".position_ids",), optional=unused)
        for name, table in (
            ("embeddings.word_embeddings.weight", self.word_embeddings),
            ("embeddings.position_embeddings.weight", self.position_embeddings),
            ("embeddings.token_type_embeddings.weight", self.token_type_embeddings),
        ):
            m.add(name, _table_loader(name, table))
        _add_norm(m, "embeddings.LayerNorm", self.embeddings_norm)
        d = self.hidden_size
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, BertLayer)
            p = f"encoder.layer.{i}."
            shards = (
                ("attention.self.query", layer.qkv, 0, d),
                ("attention.self.key", layer.qkv, d, d),
                ("attention.self.value", layer.qkv, 2 * d, d),
                ("attention.output.dense", layer.attn_out, 0, d),
                ("intermediate.dense", layer.intermediate, 0, layer.intermediate.out_features),
                ("output.dense", layer.output, 0, d),
            )
            for hf_name, lin, start, rows in shards:
                _add_linear(m, p + hf_name, lin, start, rows)
            _add_norm(m, p + "attention.output.LayerNorm", layer.attn_norm)
            _add_norm(m, p + "output.LayerNorm", layer.out_norm)
        if self.pooler is not None and self.classifier is not None:
            _add_linear(m, "pooler.dense", self.pooler, 0, d)
            _add_linear(m, "classifier", self.classifier, 0, self.classifier.out_features)
        else:
            for name in unused:
                m.add(name, lambda _t: None)
        m.load_all(weights)
        pack_linears(self, self.quantization)


def _refuse_options(config: Any) -> None:
    position = config_get(config, "position_embedding_type", "absolute")
    if position != "absolute":
        raise UnsupportedModelError(
            f"BERT with position_embedding_type={position!r} is not supported (absolute only)"
        )
    for name in ("is_decoder", "add_cross_attention"):
        if config_get(config, name, False):
            raise UnsupportedModelError(f"BERT with {name}=True is not supported (an encoder)")


def _table_loader(name: str, table: Embedding) -> Callable[[torch.Tensor], None]:
    return lambda t: table.load(name, t)


def _add_linear(m: WeightMap, name: str, lin: Linear, start: int, rows: int) -> None:
    m.add(f"{name}.weight", lambda t: lin.load_weight(f"{name}.weight", t, start, rows))
    m.add(f"{name}.bias", lambda t: lin.load_bias(f"{name}.bias", t, start, rows))


def _add_norm(m: WeightMap, name: str, norm: LayerNorm) -> None:
    for part, param in (("weight", norm.weight), ("bias", norm.bias)):

        def load(t: torch.Tensor, key: str = f"{name}.{part}", p: torch.Tensor = param) -> None:
            check_shape(key, t, tuple(p.shape))
            with torch.no_grad():
                p.copy_(t)

        m.add(f"{name}.{part}", load)
