"""Llama (`LlamaForCausalLM` configs, SmolLM2 among them) on flattened token batches and a
paged KV cache, and the Qwen2 and Qwen3 variants of its layer.

RMSNorm, rotary positions (default, linear or `llama3` scaling), grouped-query attention,
a SwiGLU MLP, tied or untied LM head. q/k/v and gate/up are fused into one linear layer
each at load time, so a step runs two products where the checkpoint has five. Qwen2 adds
biases to q/k/v (not o); Qwen3 normalizes each q and k head (RMSNorm over head_dim)
before the rotation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
from torch import nn

from flowllm.models.causal_lm import KVCache, PagedCausalLM
from flowllm.models.context import AttentionContext
from flowllm.models.errors import UnsupportedModelError
from flowllm.models.layers import (
    Embedding,
    GatedActivation,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    StepRotary,
    WeightMap,
    check_shape,
    config_get,
    pack_linears,
    paged_attention,
    rope_inv_freq,
)


class LlamaBlock(nn.Module):
    """RMSNorm -> GQA attention with RoPE -> residual; RMSNorm -> SwiGLU MLP -> residual."""

    def __init__(
        self,
        config: Any,
        dtype: torch.dtype,
        device: torch.device,
        qkv_bias: bool | None = None,
        qk_norm: bool = False,
    ) -> None:
        """qkv_bias: q/k/v biases whatever `attention_bias` says (Qwen2); qk_norm: RMSNorm
        of each q and k head (Qwen3)."""
        super().__init__()
        d = int(config_get(config, "hidden_size"))
        self.num_heads = int(config_get(config, "num_attention_heads"))
        self.num_kv_heads = int(config_get(config, "num_key_value_heads", self.num_heads))
        self.head_dim = int(config_get(config, "head_dim", d // self.num_heads))
        self.intermediate = int(config_get(config, "intermediate_size"))
        eps = float(config_get(config, "rms_norm_eps", 1e-6))
        attn_bias = bool(config_get(config, "attention_bias", False))
        mlp_bias = bool(config_get(config, "mlp_bias", False))
        act = str(config_get(config, "hidden_act", "silu"))
        self.act_and_mul = GatedActivation(act, "Llama")
        self.scale = self.head_dim**-0.5
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.input_layernorm = RMSNorm(d, eps, dtype, device)
        # qkv rows: [q (H * Dh) | k (kvh * Dh) | v (kvh * Dh)]
        qkv_bias = attn_bias if qkv_bias is None else qkv_bias
        self.qkv_proj = Linear(d, self.q_size + 2 * self.kv_size, qkv_bias, dtype, device)
        self.q_norm = RMSNorm(self.head_dim, eps, dtype, device) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, dtype, device) if qk_norm else None
        self.o_proj = Linear(self.q_size, d, attn_bias, dtype, device)
        self.post_attention_layernorm = RMSNorm(d, eps, dtype, device)
        # gate_up rows: [gate (I) | up (I)]
        self.gate_up_proj = Linear(d, 2 * self.intermediate, mlp_bias, dtype, device)
        self.down_proj = Linear(self.intermediate, d, mlp_bias, dtype, device)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        rope: StepRotary,
        kv_cache: KVCache,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the residual add waits
        for the next norm, which fuses it (vLLM's layout); `residual` is None at layer 0."""
        # h, residual: [n, d]
        n = h.shape[0]
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm.add_and_norm(h, residual)
        qkv = self.qkv_proj(x)  # [n, q_size + 2 * kv_size]
        if self.q_norm is not None and self.k_norm is not None:
            qkv = self._norm_heads(qkv)
        # q and k heads rotated together: [n, H + kvh, Dh]
        qk = rope.rotate(qkv, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, self.head_dim)
        attn = self.o_proj(paged_attention(q, k, v, kv_cache, ctx, self.scale))
        x, residual = self.post_attention_layernorm.add_and_norm(attn, residual)
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x))), residual

    def _norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv with each q head normalized by q_norm and each k head by k_norm."""
        assert self.q_norm is not None and self.k_norm is not None
        n, d = qkv.shape[0], self.head_dim
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        q = self.q_norm(qkv[:, :q_end].reshape(n * self.num_heads, d))
        k = self.k_norm(qkv[:, q_end:k_end].reshape(n * self.num_kv_heads, d))
        return torch.cat((q.view(n, -1), k.view(n, -1), qkv[:, k_end:]), dim=1)


class LlamaModel(PagedCausalLM):
    """Llama with an LM head; `forward` returns logits only for `ctx.logits_indices`."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = hf_config
        self.dtype = dtype
        self.device = device
        d = int(config_get(hf_config, "hidden_size"))
        self.hidden_size = d
        self.vocab_size = int(config_get(hf_config, "vocab_size"))
        self.num_layers = int(config_get(hf_config, "num_hidden_layers"))
        self.num_heads = int(config_get(hf_config, "num_attention_heads"))
        self.num_kv_heads = int(config_get(hf_config, "num_key_value_heads", self.num_heads))
        self.head_dim = int(config_get(hf_config, "head_dim", d // self.num_heads))
        self.max_position_embeddings = int(config_get(hf_config, "max_position_embeddings", 2048))
        self.tie_word_embeddings = bool(config_get(hf_config, "tie_word_embeddings", False))
        eps = float(config_get(hf_config, "rms_norm_eps", 1e-6))
        self.rotary = RotaryEmbedding(
            rope_inv_freq(hf_config, self.head_dim), self.max_position_embeddings, dtype, device
        )
        # float32 logits straight from the product (see Linear.out_dtype)
        self.lm_head = Linear(d, self.vocab_size, False, dtype, device, out_dtype=torch.float32)
        self.embed_tokens = Embedding(
            self.vocab_size,
            d,
            dtype,
            device,
            tied_to=self.lm_head if self.tie_word_embeddings else None,
        )
        self.layers = nn.ModuleList(
            self.make_block(hf_config, dtype, device) for _ in range(self.num_layers)
        )
        self.norm = RMSNorm(d, eps, dtype, device)

    @staticmethod
    def make_block(config: Any, dtype: torch.dtype, device: torch.device) -> LlamaBlock:
        """One layer (the Qwen variants set its options)."""
        return LlamaBlock(config, dtype, device)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The token embeddings [n, d] (positions enter through RoPE, in the layers)."""
        embeddings: torch.Tensor = self.embed_tokens(input_ids)
        return embeddings

    def forward_layers(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[KVCache],
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, ...]:
        """Every layer over all n rows: (last MLP output, residual stream before it), or
        (h,) without layers. Their K/V go to the cache."""
        rope = self.rotary.for_step(positions, ctx.max_seq_len)  # positions < max_seq_len
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, rope, kv_cache, ctx)
        return (h,) if residual is None else (h, residual)

    @property
    def final_norm(self) -> RMSNorm:
        return self.norm

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF Llama tensors (prefixed `model.` or not), fusing q/k/v and gate/up, then
        pack the linear weights (see `flowllm.models.layers`)."""
        tied = self.tie_word_embeddings
        m = WeightMap(
            prefixes=("model.",),
            ignored_suffixes=(".rotary_emb.inv_freq",),
            optional=frozenset({"lm_head.weight"}) if tied else frozenset(),
        )
        m.add("embed_tokens.weight", lambda t: self.embed_tokens.load("embed_tokens.weight", t))
        if tied:
            m.add("lm_head.weight", lambda t: self.embed_tokens.load("lm_head.weight", t))
        else:
            m.add("lm_head.weight", lambda t: self.lm_head.load_weight("lm_head.weight", t))
        m.add("norm.weight", _param_loader("norm.weight", self.norm.weight))
        for i, layer in enumerate(cast("Iterable[LlamaBlock]", self.layers)):
            p = f"layers.{i}."
            for norm in ("input_layernorm", "post_attention_layernorm"):
                name = f"{p}{norm}.weight"
                m.add(name, _param_loader(name, getattr(layer, norm).weight))
            if layer.q_norm is not None and layer.k_norm is not None:
                for norm, module in (("q_norm", layer.q_norm), ("k_norm", layer.k_norm)):
                    name = f"{p}self_attn.{norm}.weight"
                    m.add(name, _param_loader(name, module.weight))
            q, kv, inter = layer.q_size, layer.kv_size, layer.intermediate
            shards = (
                ("self_attn.q_proj", layer.qkv_proj, 0, q),
                ("self_attn.k_proj", layer.qkv_proj, q, kv),
                ("self_attn.v_proj", layer.qkv_proj, q + kv, kv),
                ("self_attn.o_proj", layer.o_proj, 0, layer.o_proj.out_features),
                ("mlp.gate_proj", layer.gate_up_proj, 0, inter),
                ("mlp.up_proj", layer.gate_up_proj, inter, inter),
                ("mlp.down_proj", layer.down_proj, 0, layer.down_proj.out_features),
            )
            for hf_name, lin, start, rows in shards:
                m.add(
                    f"{p}{hf_name}.weight", _shard_loader(f"{p}{hf_name}.weight", lin, start, rows)
                )
                if lin.bias is not None:
                    m.add(
                        f"{p}{hf_name}.bias", _bias_loader(f"{p}{hf_name}.bias", lin, start, rows)
                    )
        m.load_all(weights)
        pack_linears(self, self.quantization)


def _param_loader(name: str, param: torch.Tensor) -> Callable[[torch.Tensor], None]:
    def load(t: torch.Tensor) -> None:
        check_shape(name, t, tuple(param.shape))
        with torch.no_grad():
            param.copy_(t)

    return load


def _shard_loader(name: str, lin: Linear, start: int, rows: int) -> Callable[[torch.Tensor], None]:
    return lambda t: lin.load_weight(name, t, start=start, rows=rows)


def _bias_loader(name: str, lin: Linear, start: int, rows: int) -> Callable[[torch.Tensor], None]:
    return lambda t: lin.load_bias(name, t, start=start, rows=rows)


def _refuse_sliding_window(config: Any, model: str) -> None:
    if config_get(config, "use_sliding_window", False):
        raise UnsupportedModelError(f"{model} with sliding-window attention is not supported")


class Qwen2Model(LlamaModel):
    """Qwen2 / Qwen2.5: the Llama layer with q/k/v biases."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        _refuse_sliding_window(hf_config, "Qwen2")
        super().__init__(hf_config, dtype, device)

    @staticmethod
    def make_block(config: Any, dtype: torch.dtype, device: torch.device) -> LlamaBlock:
        return LlamaBlock(config, dtype, device, qkv_bias=True)


class Qwen3Model(LlamaModel):
    """Qwen3: the Llama layer with per-head q/k RMSNorm (biases as `attention_bias` says)."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        _refuse_sliding_window(hf_config, "Qwen3")
        super().__init__(hf_config, dtype, device)

    @staticmethod
    def make_block(config: Any, dtype: torch.dtype, device: torch.device) -> LlamaBlock:
        return LlamaBlock(config, dtype, device, qk_norm=True)
