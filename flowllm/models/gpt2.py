"""GPT-2 (`GPT2LMHeadModel` configs: gpt2 and its larger siblings, distilgpt2) on flattened
token batches and a paged KV cache.

Learned absolute positions, pre-LayerNorm blocks (each residual add fused into the next
norm, as in Llama), fused QKV, a GELU MLP, and an LM head
tied to the token embedding unless the config unties it (one checkpoint tensor loads both;
see `flowllm.models.layers` for when each keeps its own copy).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
from torch import nn

from flowllm.models.causal_lm import KVCache, PagedCausalLM
from flowllm.models.context import AttentionContext
from flowllm.models.layers import (
    Embedding,
    LayerNorm,
    Linear,
    WeightMap,
    activation,
    check_shape,
    config_get,
    pack_linears,
    paged_attention,
)


class GPT2Block(nn.Module):
    """ln_1 -> causal attention -> residual; ln_2 -> MLP -> residual."""

    def __init__(
        self, config: Any, layer_idx: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        d = int(config_get(config, "n_embd"))
        self.num_heads = int(config_get(config, "n_head"))
        self.head_dim = d // self.num_heads
        inner = int(config_get(config, "n_inner", 4 * d))
        eps = float(config_get(config, "layer_norm_epsilon", 1e-5))
        act = str(config_get(config, "activation_function", "gelu_new"))
        self.act = activation(act, "GPT-2")
        scale = self.head_dim**-0.5 if config_get(config, "scale_attn_weights", True) else 1.0
        if config_get(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(layer_idx + 1)
        self.scale = scale
        self.ln_1 = LayerNorm(d, eps, dtype, device)
        self.c_attn = Linear(d, 3 * d, True, dtype, device)
        self.attn_proj = Linear(d, d, True, dtype, device)
        self.ln_2 = LayerNorm(d, eps, dtype, device)
        self.c_fc = Linear(d, inner, True, dtype, device)
        self.mlp_proj = Linear(inner, d, True, dtype, device)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this block's MLP output, the residual stream before it): the residual add waits
        for the next norm, which fuses it (as in Llama); `residual` is None at block 0."""
        # h, residual: [n, d]
        n = h.shape[0]
        if residual is None:
            x, residual = self.ln_1(h), h
        else:
            x, residual = self.ln_1.add_and_norm(h, residual)
        qkv = self.c_attn(x).view(n, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(1)  # each [n, H, Dh]
        attn = self.attn_proj(paged_attention(q, k, v, kv_cache, ctx, self.scale))
        x, residual = self.ln_2.add_and_norm(attn, residual)
        return self.mlp_proj(self.act(self.c_fc(x))), residual


class GPT2Model(PagedCausalLM):
    """GPT-2 with an LM head; `forward` returns logits only for `ctx.logits_indices`."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = hf_config
        self.dtype = dtype
        self.device = device
        d = int(config_get(hf_config, "n_embd"))
        self.vocab_size = int(config_get(hf_config, "vocab_size"))
        self.max_position_embeddings = int(config_get(hf_config, "n_positions", 1024))
        self.num_layers = int(config_get(hf_config, "n_layer"))
        self.num_heads = int(config_get(hf_config, "n_head"))
        self.num_kv_heads = self.num_heads
        self.head_dim = d // self.num_heads
        self.hidden_size = d
        eps = float(config_get(hf_config, "layer_norm_epsilon", 1e-5))
        self.tie_word_embeddings = bool(config_get(hf_config, "tie_word_embeddings", True))
        # float32 logits straight from the product (see Linear.out_dtype)
        self.lm_head = Linear(d, self.vocab_size, False, dtype, device, out_dtype=torch.float32)
        self.wte = Embedding(
            self.vocab_size,
            d,
            dtype,
            device,
            tied_to=self.lm_head if self.tie_word_embeddings else None,
        )
        self.wpe = nn.Parameter(
            torch.empty(self.max_position_embeddings, d, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.h = nn.ModuleList(
            GPT2Block(hf_config, i, dtype, device) for i in range(self.num_layers)
        )
        self.ln_f = LayerNorm(d, eps, dtype, device)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token plus learned position embeddings [n, d]."""
        tokens: torch.Tensor = self.wte(input_ids)
        return tokens + self.wpe.index_select(0, positions)

    def forward_layers(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[KVCache],
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, ...]:
        """Every block over all n rows: (last MLP output, residual stream before it), or
        (h,) without blocks. Their K/V go to the cache."""
        residual: torch.Tensor | None = None
        for block, kv_cache in zip(self.h, kv_caches, strict=True):
            h, residual = block(h, residual, kv_cache, ctx)
        return (h,) if residual is None else (h, residual)

    @property
    def final_norm(self) -> LayerNorm:
        return self.ln_f

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF GPT-2 tensors (prefixed `transformer.` or not; Conv1D weights [in, out]),
        then pack the linear weights (see `flowllm.models.layers`)."""
        tied = self.tie_word_embeddings
        m = WeightMap(
            prefixes=("transformer.",),
            ignored_suffixes=(".attn.bias", ".attn.masked_bias"),
            optional=frozenset({"lm_head.weight"}) if tied else frozenset(),
        )
        m.add("wte.weight", lambda t: self.wte.load("wte.weight", t))
        if tied:  # a tied checkpoint may still carry the head: the same values
            m.add("lm_head.weight", lambda t: self.wte.load("lm_head.weight", t))
        else:
            m.add("lm_head.weight", lambda t: self.lm_head.load_weight("lm_head.weight", t))
        m.add("wpe.weight", lambda t: _copy("wpe.weight", self.wpe, t))
        m.add("ln_f.weight", lambda t: _copy("ln_f.weight", self.ln_f.weight, t))
        m.add("ln_f.bias", lambda t: _copy("ln_f.bias", self.ln_f.bias, t))
        for i, block in enumerate(cast("Iterable[GPT2Block]", self.h)):
            p = f"h.{i}."
            for ln in ("ln_1", "ln_2"):
                mod = getattr(block, ln)
                m.add(p + ln + ".weight", _param_loader(p + ln + ".weight", mod.weight))
                m.add(p + ln + ".bias", _param_loader(p + ln + ".bias", mod.bias))
            for hf_name, lin in (
                ("attn.c_attn", block.c_attn),
                ("attn.c_proj", block.attn_proj),
                ("mlp.c_fc", block.c_fc),
                ("mlp.c_proj", block.mlp_proj),
            ):
                m.add(p + hf_name + ".weight", _conv1d_loader(p + hf_name + ".weight", lin))
                m.add(p + hf_name + ".bias", _bias_loader(p + hf_name + ".bias", lin))
        m.load_all(weights)
        pack_linears(self, self.quantization)


def _copy(name: str, param: torch.Tensor, t: torch.Tensor) -> None:
    check_shape(name, t, tuple(param.shape))
    with torch.no_grad():
        param.copy_(t)


def _param_loader(name: str, param: torch.Tensor) -> Callable[[torch.Tensor], None]:
    return lambda t: _copy(name, param, t)


def _conv1d_loader(name: str, lin: Linear) -> Callable[[torch.Tensor], None]:
    return lambda t: lin.load_weight(name, t, transposed=True)


def _bias_loader(name: str, lin: Linear) -> Callable[[torch.Tensor], None]:
    return lambda t: lin.load_bias(name, t)
