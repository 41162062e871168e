"""Pick the model class for a checkpoint from its config's `architectures` (or `model_type`)."""

from __future__ import annotations

from typing import Any

from flowllm.models.bert import BertModel
from flowllm.models.errors import UnsupportedModelError, WeightLoadError
from flowllm.models.gemma import Gemma2Model, Gemma3Model
from flowllm.models.gpt2 import GPT2Model
from flowllm.models.layers import config_get
from flowllm.models.llama import (
    LlamaModel,
    MistralModel,
    Phi3Model,
    Qwen2Model,
    Qwen3Model,
    SmolLM3Model,
)
from flowllm.models.moe import MixtralModel, OlmoeModel, Qwen3MoeModel

__all__ = [
    "ARCHITECTURES",
    "MODEL_TYPES",
    "UnsupportedModelError",
    "WeightLoadError",
    "model_class_for",
]

ModelClass = type[GPT2Model] | type[LlamaModel] | type[BertModel]

ARCHITECTURES: dict[str, ModelClass] = {
    "BertModel": BertModel,  # encoders: served for pooling only (--task embed or score)
    "BertForSequenceClassification": BertModel,
    "GPT2LMHeadModel": GPT2Model,
    "LlamaForCausalLM": LlamaModel,
    "Qwen2ForCausalLM": Qwen2Model,
    "Qwen3ForCausalLM": Qwen3Model,
    "MistralForCausalLM": MistralModel,
    "SmolLM3ForCausalLM": SmolLM3Model,
    "Phi3ForCausalLM": Phi3Model,
    "Gemma2ForCausalLM": Gemma2Model,
    "Gemma3ForCausalLM": Gemma3Model,
    "Qwen3MoeForCausalLM": Qwen3MoeModel,
    "OlmoeForCausalLM": OlmoeModel,
    "MixtralForCausalLM": MixtralModel,
}
MODEL_TYPES: dict[str, ModelClass] = {
    "bert": BertModel,
    "gpt2": GPT2Model,
    "llama": LlamaModel,
    "qwen2": Qwen2Model,
    "qwen3": Qwen3Model,
    "mistral": MistralModel,
    "smollm3": SmolLM3Model,
    "phi3": Phi3Model,
    "gemma2": Gemma2Model,
    "gemma3_text": Gemma3Model,
    "qwen3_moe": Qwen3MoeModel,
    "olmoe": OlmoeModel,
    "mixtral": MixtralModel,
}


def model_class_for(hf_config: Any) -> ModelClass:
    """The class implementing `hf_config`'s architecture; raises UnsupportedModelError."""
    architectures = list(config_get(hf_config, "architectures", None) or [])
    for arch in architectures:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    if not architectures:
        model_type = config_get(hf_config, "model_type", None)
        if model_type in MODEL_TYPES:
            return MODEL_TYPES[model_type]
        raise UnsupportedModelError(
            f"model type {model_type!r} (no `architectures` in the config) is not supported; "
            f"supported architectures: {', '.join(ARCHITECTURES)}"
        )
    raise UnsupportedModelError(
        f"architecture {', '.join(architectures)} is not supported; "
        f"supported architectures: {', '.join(ARCHITECTURES)}"
    )
