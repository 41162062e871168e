"""Gemma 2 (`Gemma2ForCausalLM`) and Gemma 3's text model (`Gemma3ForCausalLM`): the Llama
decoder with Gemma's changes, as transformers implements them.

- RMSNorm scales by (1 + w), in float32 (`GemmaRMSNorm`), and every layer norms its
  attention's and its MLP's outputs too ("sandwich" norms: `GemmaBlock`).
- Embeddings are scaled by sqrt(hidden_size) (rounded to the model's dtype first); the
  MLP's activation is `hidden_activation` (tanh GELU).
- Attention scales by `query_pre_attn_scalar`^-1/2; `sliding_attention` layers attend over
  a window of `sliding_window` positions, interleaved with global ones (`layer_types`, or
  Gemma 2's alternation, Gemma 3's `sliding_window_pattern`).
- Gemma 2 caps attention scores (`attn_logit_softcapping`) in the attention kernels and
  the final logits (`final_logit_softcapping`) after the LM head.
- Gemma 3 norms each q and k head (as Qwen3, with Gemma's norm) and rotates its sliding
  layers by their own theta (`rope_local_base_freq`, or `rope_parameters` per layer type).

A float32 model's norms run in the native kernel; a bfloat16 one's in torch (Gemma's
formula rounds once, after the weight, where the kernel rounds before it). The MLP's
tanh-GELU product runs in torch too, so Gemma's decode steps are not replayed
(`flowllm.models.step_plans`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from flowllm.models.causal_lm import KVCache
from flowllm.models.context import AttentionContext
from flowllm.models.layers import (
    GemmaRMSNorm,
    StepRotary,
    config_get,
    config_value,
    refuse_options,
)
from flowllm.models.llama import (
    GLOBAL_ROPE,
    BlockOptions,
    LayerAttention,
    LlamaBlock,
    LlamaModel,
    Norm,
    sliding_window,
)
from flowllm.models.rope import rope_parameters

SLIDING, FULL = "sliding_attention", "full_attention"


class GemmaBlock(LlamaBlock):
    """Norm -> attention -> norm -> residual; norm -> MLP -> norm -> residual."""

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
        super().__init__(config, dtype, device, options, attention, norm, model)
        d = int(config_get(config, "hidden_size"))
        eps = float(config_get(config, "rms_norm_eps", 1e-6))
        self.pre_feedforward_layernorm = norm(d, eps, dtype, device)
        self.post_feedforward_layernorm = norm(d, eps, dtype, device)

    def norms(self) -> dict[str, Norm]:
        return {
            **super().norms(),
            "pre_feedforward_layernorm": self.pre_feedforward_layernorm,
            "post_feedforward_layernorm": self.post_feedforward_layernorm,
        }

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        rope: StepRotary | None,
        kv_cache: KVCache,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's normed output, the residual stream before it), as LlamaBlock."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm.add_and_norm(h, residual)
        attn = self.post_attention_layernorm(self.attend(x, rope, kv_cache, ctx))
        x, residual = self.pre_feedforward_layernorm.add_and_norm(attn, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma2Model(LlamaModel):
    """Gemma 2 (see the module docstring)."""

    architecture = "Gemma2"
    block_class = GemmaBlock
    norm_class = GemmaRMSNorm
    attn_softcap_default: float | None = 50.0  # transformers' defaults where a config is silent
    final_softcap_default: float | None = 30.0

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        refuse_options(hf_config, self.architecture, ["use_bidirectional_attention"])
        super().__init__(hf_config, dtype, device)
        self.embed_scale = torch.tensor(self.hidden_size**0.5, dtype=dtype, device=self.device)
        cap = config_value(hf_config, "final_logit_softcapping", self.final_softcap_default)
        self.final_softcap = float(cap or 0.0)

    def layer_types(self, config: Any) -> list[str]:
        """Each layer's kind: `layer_types`, or every `sliding_pattern`-th layer global."""
        n = int(config_get(config, "num_hidden_layers"))
        pattern = self.sliding_pattern(config)
        given = config_get(config, "layer_types", None)
        return list(given or [SLIDING if (i + 1) % pattern else FULL for i in range(n)])

    def sliding_pattern(self, config: Any) -> int:
        """Gemma 2 alternates sliding and global layers."""
        return 2

    def block_options(self, config: Any) -> BlockOptions:
        attn_bias = bool(config_get(config, "attention_bias", False))
        return BlockOptions(
            qkv_bias=attn_bias,
            out_bias=attn_bias,
            act=str(config_get(config, "hidden_activation", "gelu_pytorch_tanh")),
        )

    def layer_attention(self, config: Any, i: int) -> LayerAttention:
        sliding = self.layer_types(config)[i] == SLIDING
        cap = config_value(config, "attn_logit_softcapping", self.attn_softcap_default)
        return LayerAttention(
            scale=float(config_get(config, "query_pre_attn_scalar", 256)) ** -0.5,
            rope=self.layer_rope(config, i),
            window=sliding_window(config, 4096) if sliding else 0,
            softcap=float(cap or 0.0),
        )

    def layer_rope(self, config: Any, i: int) -> str:
        """The rotary table layer i rotates by."""
        return GLOBAL_ROPE

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The token embeddings times sqrt(hidden_size) rounded to the model's dtype."""
        embeddings: torch.Tensor = self.embed_tokens(input_ids) * self.embed_scale
        return embeddings

    def compute_logits(
        self, hidden: tuple[torch.Tensor, ...], ctx: AttentionContext
    ) -> torch.Tensor:
        """The logits, capped as cap * tanh(logits / cap) when a final softcap is set."""
        logits = super().compute_logits(hidden, ctx)
        if self.final_softcap:
            logits = logits.div_(self.final_softcap).tanh_().mul_(self.final_softcap)
        return logits


class Gemma3Model(Gemma2Model):
    """Gemma 3's text model (see the module docstring). transformers' Gemma 3 does not cap
    attention scores, so a config that sets `attn_logit_softcapping` is refused."""

    architecture = "Gemma3"
    attn_softcap_default = None
    final_softcap_default = None

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        refuse_options(hf_config, self.architecture, ["attn_logit_softcapping"])
        super().__init__(hf_config, dtype, device)

    def sliding_pattern(self, config: Any) -> int:
        """`sliding_window_pattern` (older configs; 6 where absent): 5 sliding, 1 global."""
        return int(config_get(config, "sliding_window_pattern", 6))

    def block_options(self, config: Any) -> BlockOptions:
        return replace(super().block_options(config), qk_norm=True)

    def layer_rope(self, config: Any, i: int) -> str:
        return self.layer_types(config)[i]

    def rope_tables(self, config: Any) -> dict[str, dict[str, Any]]:
        """Global layers' rope (`rope_theta`, `rope_scaling` in older configs) and sliding
        layers' (`rope_local_base_freq`), or both from `rope_parameters` per layer type."""
        given = config_get(config, "rope_parameters", None) or {}
        if isinstance(given.get(FULL), Mapping) or isinstance(given.get(SLIDING), Mapping):
            tables = {
                kind: rope_parameters(
                    {"rope_parameters": dict(given.get(kind) or {})},
                    default_theta=1e6 if kind == FULL else 1e4,
                )
                for kind in (FULL, SLIDING)
            }
        else:
            tables = {
                FULL: rope_parameters(config, default_theta=1e6),
                SLIDING: {
                    "rope_type": "default",
                    "rope_theta": float(config_get(config, "rope_local_base_freq", 1e4)),
                },
            }
        return tables
