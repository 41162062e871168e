"""Mixture-of-experts decoders: Llama's layer with the MLP of some or all layers replaced
by a router and experts (`flowllm.models.experts`), as transformers implements them.

- Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's layer (q/k head norms); a layer is sparse
  unless `mlp_only_layers` names it or it falls between `decoder_sparse_step`s (those
  keep a dense MLP of `intermediate_size`); experts of `moe_intermediate_size`, the top-k
  weights renormalized where `norm_topk_prob` is set.
- OLMoE (`OlmoeForCausalLM`): every layer sparse, q and k normed across all their heads
  at once, experts of `intermediate_size`.
- Mixtral (`MixtralForCausalLM`): Mistral's layer (a sliding window where
  `sliding_window` is set) with every layer sparse, the top-k weights always
  renormalized and applied in float32.

Checkpoints name each expert's projections apart (`mlp.experts.{e}.gate_proj`, Mixtral's
`block_sparse_moe.experts.{e}.w1`/`w3`/`w2`); transformers 5 models hold them as one 3-D
tensor per projection (`mlp.experts.gate_up_proj` [E, 2I, d], `mlp.experts.down_proj`
[E, d, I]), which is also what `save_pretrained(save_original_format=False)` writes: both
load, the 3-D tensors split into the experts' rows (`_per_expert`). A GGUF file's 3-D
expert tensors are split by `flowllm.models.gguf_file`, each expert's slice kept quantized.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any, cast

import torch

from flowllm.models.experts import Expert, ExpertOptions, SparseMoE
from flowllm.models.layers import Linear, config_get, refuse_options
from flowllm.models.llama import (
    BlockOptions,
    LayerAttention,
    LlamaBlock,
    LlamaModel,
    Norm,
    Qwen3Model,
    sliding_window,
)

# transformers 5's names of a sparse layer's tensors: `mlp.gate.weight` and the experts'
# 3-D tensors, or each expert's projections apart
_FUSED = re.compile(
    r"^(.*layers\.\d+\.)mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)$"
)
_SPLIT = re.compile(
    r"^(.*layers\.\d+\.)mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
)


class SparseBlock(LlamaBlock):
    """Llama's layer whose MLP is a router and experts."""

    def __init__(
        self,
        config: Any,
        dtype: torch.dtype,
        device: torch.device,
        options: BlockOptions,
        attention: LayerAttention,
        norm: type[Norm],
        model: str,
        experts: ExpertOptions,
    ) -> None:
        super().__init__(config, dtype, device, options, attention, norm, model)
        d = int(config_get(config, "hidden_size"))
        self.moe = SparseMoE(d, experts, options.act, dtype, device, model)

    def build_mlp(
        self, config: Any, options: BlockOptions, dtype: torch.dtype, device: torch.device
    ) -> None:
        """None: the experts (`moe`) are this layer's MLP."""

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.moe(x)
        return out


class MoEModel(LlamaModel):
    """A Llama-layer decoder with sparse layers. Subclasses say which layers are sparse
    (`sparse_layer`), their experts (`expert_options`) and their checkpoint's names."""

    expert_prefix = "mlp"  # a sparse layer's tensors, below `layers.{i}.`
    expert_projections = ("gate_proj", "up_proj", "down_proj")  # gate, up, down

    def sparse_layer(self, config: Any, i: int) -> bool:
        """Whether layer i has experts (here: every layer)."""
        return True

    @abc.abstractmethod
    def expert_options(self, config: Any) -> ExpertOptions:
        """The experts of every sparse layer."""

    def make_layer(self, config: Any, i: int, options: BlockOptions) -> LlamaBlock:
        if not self.sparse_layer(config, i):
            return super().make_layer(config, i, options)
        return SparseBlock(
            config,
            self.dtype,
            self.device,
            options,
            self.layer_attention(config, i),
            self.norm_class,
            self.architecture,
            self.expert_options(config),
        )

    def mlp_shards(self, layer: LlamaBlock) -> list[tuple[str, Linear, int, int]]:
        if not isinstance(layer, SparseBlock):
            return super().mlp_shards(layer)
        p = self.expert_prefix
        gate, up, down = self.expert_projections
        moe = layer.moe
        shards = [(f"{p}.gate", moe.gate, 0, moe.gate.out_features)]
        for e, expert in enumerate(cast("Iterable[Expert]", moe.experts)):
            inter = expert.intermediate
            shards += [
                (f"{p}.experts.{e}.{gate}", expert.gate_up_proj, 0, inter),
                (f"{p}.experts.{e}.{up}", expert.gate_up_proj, inter, inter),
                (f"{p}.experts.{e}.{down}", expert.down_proj, 0, expert.down_proj.out_features),
            ]
        return shards

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load as Llama does, the experts' 3-D tensors split per expert first."""
        super().load_weights(self._per_expert(weights))

    def _per_expert(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each checkpoint tensor under this model's names: transformers 5's 3-D expert
        tensors split into each expert's [rows, in] weights, its per-expert names
        (`mlp.experts.{e}.gate_proj`, as GGUF files give them) renamed to the family's."""
        p = self.expert_prefix
        gate, up, down = self.expert_projections
        renamed = {"gate_proj": gate, "up_proj": up, "down_proj": down}
        for name, w in weights:
            split, fused = _SPLIT.match(name), _FUSED.match(name)
            if split is not None:
                layer, e, proj = split.groups()
                yield f"{layer}{p}.experts.{e}.{renamed[proj]}.weight", w
                continue
            if fused is None:
                yield name, w
                continue
            layer, what = fused.groups()
            if what == "gate.weight":
                yield f"{layer}{p}.gate.weight", w
            elif what == "experts.gate_up_proj":  # [E, 2I, d]: gate rows, then up
                inter = w.shape[1] // 2
                for e, rows in enumerate(w):
                    yield f"{layer}{p}.experts.{e}.{gate}.weight", rows[:inter]
                    yield f"{layer}{p}.experts.{e}.{up}.weight", rows[inter:]
            else:  # experts.down_proj [E, d, I]
                for e, rows in enumerate(w):
                    yield f"{layer}{p}.experts.{e}.{down}.weight", rows


def _num_experts(config: Any) -> int:
    """`num_experts`, or `num_local_experts` as transformers 5 saves it (and Mixtral names
    it)."""
    num = config_get(config, "num_experts", None)
    return int(config_get(config, "num_local_experts", 0) if num is None else num)


def _experts(config: Any, intermediate: int, norm_topk_prob: bool) -> ExpertOptions:
    """A config's experts: `_num_experts`, `num_experts_per_tok` each token uses."""
    return ExpertOptions(
        num_experts=_num_experts(config),
        top_k=int(config_get(config, "num_experts_per_tok")),
        intermediate=intermediate,
        norm_topk_prob=norm_topk_prob,
    )


class Qwen3MoeModel(MoEModel, Qwen3Model):
    """Qwen3-MoE (see the module docstring)."""

    architecture = "Qwen3MoE"

    def sparse_layer(self, config: Any, i: int) -> bool:
        step = int(config_get(config, "decoder_sparse_step", 1))
        only_mlp = config_get(config, "mlp_only_layers", None) or []
        return i not in only_mlp and _num_experts(config) > 0 and (i + 1) % step == 0

    def expert_options(self, config: Any) -> ExpertOptions:
        return _experts(
            config,
            int(config_get(config, "moe_intermediate_size", 768)),
            bool(config_get(config, "norm_topk_prob", False)),
        )


class OlmoeModel(MoEModel):
    """OLMoE (see the module docstring). `clip_qkv` is refused: flowllm does not clamp
    q, k and v."""

    architecture = "OLMoE"

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        refuse_options(hf_config, self.architecture, ["clip_qkv"])
        super().__init__(hf_config, dtype, device)

    def block_options(self, config: Any) -> BlockOptions:
        return replace(super().block_options(config), qk_norm=True, qk_norm_whole=True)

    def expert_options(self, config: Any) -> ExpertOptions:
        return _experts(
            config,
            int(config_get(config, "intermediate_size")),
            bool(config_get(config, "norm_topk_prob", False)),
        )


class MixtralModel(MoEModel):
    """Mixtral (see the module docstring)."""

    architecture = "Mixtral"
    default_theta = 1000000.0
    expert_prefix = "block_sparse_moe"
    expert_projections = ("w1", "w3", "w2")

    def block_options(self, config: Any) -> BlockOptions:
        return BlockOptions(act=str(config_get(config, "hidden_act", "silu")))

    def layer_attention(self, config: Any, i: int) -> LayerAttention:
        return LayerAttention(scale=self.head_dim**-0.5, window=sliding_window(config))

    def expert_options(self, config: Any) -> ExpertOptions:
        experts = _experts(config, int(config_get(config, "intermediate_size")), True)
        return replace(experts, weights_in_model_dtype=False)
