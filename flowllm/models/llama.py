"""Llama (`LlamaForCausalLM` configs, SmolLM2 among them) on flattened token batches and a
paged KV cache, and the decoders that are its layer with options: Qwen2, Qwen3, Mistral,
SmolLM3 and Phi-3 here, Gemma 2 and 3 in `flowllm.models.gemma`, and the mixtures of
experts (Qwen3-MoE, OLMoE, Mixtral: some or all layers' MLP a router and experts) in
`flowllm.models.moe`.

RMSNorm, rotary positions (`flowllm.models.rope`), grouped-query attention, a SwiGLU MLP,
tied or untied LM head. q/k/v and gate/up are fused into one linear layer each at load
time, so a step runs two products where the checkpoint has five. What a model changes:
- its layers' `BlockOptions`: biases (Qwen2 on q/k/v, `attention_bias` elsewhere), a
  per-head RMSNorm of q and k before the rotation (Qwen3), the activation;
- each layer's `LayerAttention`: its rotary table (none in SmolLM3's NoPE layers), a
  sliding window (Mistral, Phi-3, SmolLM3's sliding layers), the softmax scale;
- its checkpoint's names (Phi-3's projections come fused already).
Options a checkpoint sets that these classes do not run are refused at construction, by
name (`refuse_options`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from flowllm.models.causal_lm import KVCache, PagedCausalLM
from flowllm.models.context import AttentionContext
from flowllm.models.layers import (
    Embedding,
    GatedActivation,
    GemmaRMSNorm,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    StepRotary,
    WeightMap,
    config_get,
    config_value,
    pack_linears,
    paged_attention,
    refuse_options,
)
from flowllm.models.rope import rope_frequencies, rope_parameters

Norm = RMSNorm | GemmaRMSNorm
GLOBAL_ROPE = "global"  # the rotary table of models with one


@dataclass(frozen=True)
class BlockOptions:
    """What a model's layers have beyond Llama's plain layer."""

    qkv_bias: bool = False
    out_bias: bool = False  # o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # a norm of each q and k head before the rotation
    qk_norm_whole: bool = False  # that norm across all q (all k) heads at once (OLMoE)
    act: str = "silu"


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends: its softmax scale, its rotary table (a key of the model's
    `rotaries`; None: no RoPE), its sliding window (0: none) and score cap (0: none)."""

    scale: float
    rope: str | None = GLOBAL_ROPE
    window: int = 0
    softcap: float = 0.0


class LlamaBlock(nn.Module):
    """RMSNorm -> GQA attention with RoPE -> residual; RMSNorm -> SwiGLU MLP -> residual."""

    def __init__(
        self,
        config: Any,
        dtype: torch.dtype,
        device: torch.device,
        options: BlockOptions,
        attention: LayerAttention,
        norm: type[Norm],
        model: str,
    ) -> None:
        super().__init__()
        d = int(config_get(config, "hidden_size"))
        self.num_heads = int(config_get(config, "num_attention_heads"))
        self.num_kv_heads = int(config_get(config, "num_key_value_heads", self.num_heads))
        self.head_dim = int(config_get(config, "head_dim", d // self.num_heads))
        eps = float(config_get(config, "rms_norm_eps", 1e-6))
        self.act_and_mul = GatedActivation(options.act, model)
        self.attention = attention
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.input_layernorm = norm(d, eps, dtype, device)
        # qkv rows: [q (H * Dh) | k (kvh * Dh) | v (kvh * Dh)]
        self.qkv_proj = Linear(d, self.q_size + 2 * self.kv_size, options.qkv_bias, dtype, device)
        whole = options.qk_norm_whole
        q_width, k_width = (self.q_size, self.kv_size) if whole else (self.head_dim,) * 2
        self.q_norm = norm(q_width, eps, dtype, device) if options.qk_norm else None
        self.k_norm = norm(k_width, eps, dtype, device) if options.qk_norm else None
        self.o_proj = Linear(self.q_size, d, options.out_bias, dtype, device)
        self.post_attention_layernorm = norm(d, eps, dtype, device)
        self.build_mlp(config, options, dtype, device)

    def build_mlp(
        self, config: Any, options: BlockOptions, dtype: torch.dtype, device: torch.device
    ) -> None:
        """The MLP's projections: gate/up fused, then down."""
        d = int(config_get(config, "hidden_size"))
        self.intermediate = int(config_get(config, "intermediate_size"))
        # gate_up rows: [gate (I) | up (I)]
        self.gate_up_proj = Linear(d, 2 * self.intermediate, options.mlp_bias, dtype, device)
        self.down_proj = Linear(self.intermediate, d, options.mlp_bias, dtype, device)

    def norms(self) -> dict[str, Norm]:
        """The layer's norms by checkpoint name (below `layers.{i}.`)."""
        out: dict[str, Norm] = {
            "input_layernorm": self.input_layernorm,
            "post_attention_layernorm": self.post_attention_layernorm,
        }
        if self.q_norm is not None and self.k_norm is not None:
            out["self_attn.q_norm"] = self.q_norm
            out["self_attn.k_norm"] = self.k_norm
        return out

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        rope: StepRotary | None,
        kv_cache: KVCache,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the residual add waits
        for the next norm, which fuses it (vLLM's layout); `residual` is None at layer 0."""
        # h, residual: [n, d]
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm.add_and_norm(h, residual)
        attn = self.attend(x, rope, kv_cache, ctx)
        x, residual = self.post_attention_layernorm.add_and_norm(attn, residual)
        return self.mlp(x), residual

    def attend(
        self, x: torch.Tensor, rope: StepRotary | None, kv_cache: KVCache, ctx: AttentionContext
    ) -> torch.Tensor:
        """The attention block of normed rows x [n, d] -> [n, d]; K/V go to the cache."""
        n = x.shape[0]
        qkv = self.qkv_proj(x)  # [n, q_size + 2 * kv_size]
        if self.q_norm is not None and self.k_norm is not None:
            qkv = self._norm_heads(qkv)
        heads = self.num_heads + self.num_kv_heads
        if rope is None:
            qk = qkv[:, : self.q_size + self.kv_size].view(n, heads, self.head_dim)
        else:  # q and k heads rotated together: [n, H + kvh, Dh]
            qk = rope.rotate(qkv, heads, self.head_dim)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, self.head_dim)
        a = self.attention
        out: torch.Tensor = self.o_proj(
            paged_attention(q, k, v, kv_cache, ctx, a.scale, a.window, a.softcap)
        )
        return out

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act_and_mul(self.gate_up_proj(x)))
        return out

    def _norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv with each q head normalized by q_norm and each k head by k_norm (or all q
        heads at once and all k heads, where the norms are that wide)."""
        assert self.q_norm is not None and self.k_norm is not None
        n = qkv.shape[0]
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        # contiguous rows, which the native norm takes one at a time
        q = self.q_norm(qkv[:, :q_end].reshape(-1, self.q_norm.weight.shape[0]).contiguous())
        k = self.k_norm(qkv[:, q_end:k_end].reshape(-1, self.k_norm.weight.shape[0]).contiguous())
        return torch.cat((q.view(n, -1), k.view(n, -1), qkv[:, k_end:]), dim=1)


class LlamaModel(PagedCausalLM):
    """Llama with an LM head; `forward` returns logits only for `ctx.logits_indices`.

    Subclasses set their layers' options (`block_options`, `layer_attention`) or the layers
    themselves (`make_layer`), their rotary tables (`rope_tables`) and their checkpoint's
    names (`attention_shards`, `mlp_shards`)."""

    architecture = "Llama"  # the name refusals give
    default_theta = 10000.0  # transformers' rope_theta where a config gives none
    block_class: type[LlamaBlock] = LlamaBlock
    norm_class: type[Norm] = RMSNorm

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
        self.context_len = self.max_position_embeddings  # what the rotary tables serve
        self.rotaries = self._rotaries(self.context_len)
        # float32 logits straight from the product (see Linear.out_dtype)
        self.lm_head = Linear(d, self.vocab_size, False, dtype, device, out_dtype=torch.float32)
        self.embed_tokens = Embedding(
            self.vocab_size,
            d,
            dtype,
            device,
            tied_to=self.lm_head if self.tie_word_embeddings else None,
        )
        options = self.block_options(hf_config)
        self.layers = nn.ModuleList(
            self.make_layer(hf_config, i, options) for i in range(self.num_layers)
        )
        self.norm = self.norm_class(d, eps, dtype, device)

    # ---- what subclasses change

    def make_layer(self, config: Any, i: int, options: BlockOptions) -> LlamaBlock:
        """Layer i (Llama: a `block_class` with the shared options and its attention)."""
        return self.block_class(
            config,
            self.dtype,
            self.device,
            options,
            self.layer_attention(config, i),
            self.norm_class,
            self.architecture,
        )

    def block_options(self, config: Any) -> BlockOptions:
        """The options every layer shares (Llama: `attention_bias` on q/k/v/o, `mlp_bias`)."""
        attn_bias = bool(config_get(config, "attention_bias", False))
        return BlockOptions(
            qkv_bias=attn_bias,
            out_bias=attn_bias,
            mlp_bias=bool(config_get(config, "mlp_bias", False)),
            act=str(config_get(config, "hidden_act", "silu")),
        )

    def layer_attention(self, config: Any, i: int) -> LayerAttention:
        """How layer i attends (Llama: every layer alike, by the global rotary table)."""
        return LayerAttention(scale=self.head_dim**-0.5)

    def rope_tables(self, config: Any) -> dict[str, dict[str, Any]]:
        """Each rotary table's rope parameters, by the name layers give it."""
        return {GLOBAL_ROPE: rope_parameters(config, default_theta=self.default_theta)}

    def attention_shards(self, layer: LlamaBlock) -> list[tuple[str, Linear, int, int]]:
        """(checkpoint name, layer, first row, rows) of the attention's projections."""
        q, kv = layer.q_size, layer.kv_size
        return [
            ("self_attn.q_proj", layer.qkv_proj, 0, q),
            ("self_attn.k_proj", layer.qkv_proj, q, kv),
            ("self_attn.v_proj", layer.qkv_proj, q + kv, kv),
            ("self_attn.o_proj", layer.o_proj, 0, layer.o_proj.out_features),
        ]

    def mlp_shards(self, layer: LlamaBlock) -> list[tuple[str, Linear, int, int]]:
        """(checkpoint name, layer, first row, rows) of the MLP's projections."""
        inter = layer.intermediate
        return [
            ("mlp.gate_proj", layer.gate_up_proj, 0, inter),
            ("mlp.up_proj", layer.gate_up_proj, inter, inter),
            ("mlp.down_proj", layer.down_proj, 0, layer.down_proj.out_features),
        ]

    # ----

    def _rotaries(self, context_len: int) -> dict[str, RotaryEmbedding]:
        rotaries = {}
        for name, params in self.rope_tables(self.config).items():
            rope = rope_frequencies(
                self.config, params, self.head_dim, context_len, self.architecture
            )
            rotaries[name] = RotaryEmbedding(
                rope.inv_freq, context_len, self.dtype, self.device, rope.attention_scaling
            )
        return rotaries

    def limit_context(self, max_model_len: int) -> None:
        """Serve sequences of up to `max_model_len` tokens: the rotary tables are made for
        that context (LongRoPE picks its factors by it)."""
        if max_model_len != self.context_len:
            self.context_len = max_model_len
            self.rotaries = self._rotaries(max_model_len)

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
        # positions < max_seq_len
        ropes = {name: r.for_step(positions, ctx.max_seq_len) for name, r in self.rotaries.items()}
        residual: torch.Tensor | None = None
        layers = cast("Iterable[LlamaBlock]", self.layers)
        for layer, kv_cache in zip(layers, kv_caches, strict=True):
            rope = None if layer.attention.rope is None else ropes[layer.attention.rope]
            h, residual = layer(h, residual, rope, kv_cache, ctx)
        return (h,) if residual is None else (h, residual)

    @property
    def final_norm(self) -> Norm:
        return self.norm

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF tensors (prefixed `model.` or not), fusing q/k/v and gate/up, then pack
        the linear weights (see `flowllm.models.layers`)."""
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
        m.add("norm.weight", _norm_loader("norm.weight", self.norm))
        for i, layer in enumerate(cast("Iterable[LlamaBlock]", self.layers)):
            p = f"layers.{i}."
            for norm_name, norm in layer.norms().items():
                name = f"{p}{norm_name}.weight"
                m.add(name, _norm_loader(name, norm))
            for hf_name, lin, start, rows in self.attention_shards(layer) + self.mlp_shards(layer):
                name = f"{p}{hf_name}"
                m.add(f"{name}.weight", _shard_loader(f"{name}.weight", lin, start, rows))
                if lin.bias is not None:
                    m.add(f"{name}.bias", _bias_loader(f"{name}.bias", lin, start, rows))
        m.load_all(weights)
        pack_linears(self, self.quantization)


def _norm_loader(name: str, norm: Norm) -> Callable[[torch.Tensor], None]:
    return lambda t: norm.load(name, t)


def _shard_loader(name: str, lin: Linear, start: int, rows: int) -> Callable[[torch.Tensor], None]:
    return lambda t: lin.load_weight(name, t, start=start, rows=rows)


def _bias_loader(name: str, lin: Linear, start: int, rows: int) -> Callable[[torch.Tensor], None]:
    return lambda t: lin.load_bias(name, t, start=start, rows=rows)


def sliding_window(config: Any, default: int | None = None) -> int:
    """The config's `sliding_window` (0: none, when null; `default` when absent)."""
    return int(config_value(config, "sliding_window", default) or 0)


class Qwen2Model(LlamaModel):
    """Qwen2 / Qwen2.5: the Llama layer with q/k/v biases."""

    architecture = "Qwen2"

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        refuse_options(hf_config, self.architecture, ["use_sliding_window"])
        super().__init__(hf_config, dtype, device)

    def block_options(self, config: Any) -> BlockOptions:
        return BlockOptions(qkv_bias=True, act=str(config_get(config, "hidden_act", "silu")))


class Qwen3Model(LlamaModel):
    """Qwen3: the Llama layer with per-head q/k RMSNorm (biases as `attention_bias` says)."""

    architecture = "Qwen3"

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        refuse_options(hf_config, self.architecture, ["use_sliding_window"])
        super().__init__(hf_config, dtype, device)

    def block_options(self, config: Any) -> BlockOptions:
        attn_bias = bool(config_get(config, "attention_bias", False))
        return BlockOptions(
            qkv_bias=attn_bias,
            out_bias=attn_bias,
            qk_norm=True,
            act=str(config_get(config, "hidden_act", "silu")),
        )


class MistralModel(LlamaModel):
    """Mistral: the Llama layer without biases, every layer attending over a sliding window
    of `sliding_window` positions (none when it is null; 4096, transformers' default, when
    the config does not name it)."""

    architecture = "Mistral"

    def block_options(self, config: Any) -> BlockOptions:
        return BlockOptions(act=str(config_get(config, "hidden_act", "silu")))

    def layer_attention(self, config: Any, i: int) -> LayerAttention:
        return LayerAttention(scale=self.head_dim**-0.5, window=sliding_window(config, 4096))


class SmolLM3Model(LlamaModel):
    """SmolLM3: the Llama layer, without RoPE in the layers `no_rope_layers` marks 0 (every
    `no_rope_layer_interval`-th layer when it is not given), and a sliding window on the
    `sliding_attention` layers when `use_sliding_window` is set, as transformers reads
    them."""

    architecture = "SmolLM3"
    default_theta = 2000000.0

    def layer_attention(self, config: Any, i: int) -> LayerAttention:
        n = int(config_get(config, "num_hidden_layers"))
        interval = int(config_get(config, "no_rope_layer_interval", 4))
        uses_rope = config_get(config, "no_rope_layers", None) or [
            int((j + 1) % interval != 0) for j in range(n)
        ]
        use_window = bool(config_get(config, "use_sliding_window", False))
        window = sliding_window(config)
        layer_types = config_get(config, "layer_types", None) or [
            "sliding_attention" if use_window and window and not uses_rope[j] else "full_attention"
            for j in range(n)
        ]
        sliding = use_window and layer_types[i] == "sliding_attention"
        return LayerAttention(
            scale=self.head_dim**-0.5,
            rope=GLOBAL_ROPE if uses_rope[i] else None,
            window=window if sliding else 0,
        )


class Phi3Model(LlamaModel):
    """Phi-3 and Phi-4-mini: the Llama layer without biases, its checkpoint's q/k/v and
    gate/up projections fused already (loaded whole), LongRoPE (`longrope`, and the older
    names `su` and `yarn` Phi-3 configs give it), a partial rotary factor, and a sliding
    window where `sliding_window` is set."""

    architecture = "Phi3"

    def block_options(self, config: Any) -> BlockOptions:
        return BlockOptions(act=str(config_get(config, "hidden_act", "silu")))

    def layer_attention(self, config: Any, i: int) -> LayerAttention:
        return LayerAttention(scale=self.head_dim**-0.5, window=sliding_window(config))

    def rope_tables(self, config: Any) -> dict[str, dict[str, Any]]:
        params = rope_parameters(config, default_theta=self.default_theta)
        if params["rope_type"] in ("su", "yarn"):
            params["rope_type"] = "longrope"
        params.setdefault(
            "original_max_position_embeddings",
            int(config_get(config, "original_max_position_embeddings", 4096)),
        )
        return {GLOBAL_ROPE: params}

    def attention_shards(self, layer: LlamaBlock) -> list[tuple[str, Linear, int, int]]:
        return [
            ("self_attn.qkv_proj", layer.qkv_proj, 0, layer.qkv_proj.out_features),
            ("self_attn.o_proj", layer.o_proj, 0, layer.o_proj.out_features),
        ]

    def mlp_shards(self, layer: LlamaBlock) -> list[tuple[str, Linear, int, int]]:
        return [
            ("mlp.gate_up_proj", layer.gate_up_proj, 0, layer.gate_up_proj.out_features),
            ("mlp.down_proj", layer.down_proj, 0, layer.down_proj.out_features),
        ]
