"""Mistral, SmolLM3, Phi-3, Gemma 2, Gemma 3 and the mixture-of-experts families served
from the files people have: a safetensors directory as transformers saves it (experts
apart, or in transformers 5's own 3-D layout) and a config.json in the older style Hub
checkpoints carry, exact against transformers; Phi-3, SmolLM3, Gemma, Qwen3-MoE, OLMoE
and Mixtral GGUF files as llama.cpp writes them, exact dequantized and close quantized."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_fixtures import dequantized_like, gemma_for_gguf, moe_for_gguf, write_gguf
from model_test_utils import paged_logits, reference_logits
from test_model_equivalence import (
    SMALL,
    gemma_reference,
    mistral_reference,
    moe_reference,
    phi3_reference,
    smollm3_reference,
)
from transformers import SmolLM3Config, SmolLM3ForCausalLM

from flowllm.models import gguf_file
from flowllm.models.layers import Linear
from flowllm.models.llama import Phi3Model
from flowllm.models.loader import load_model

VOCAB = 512


def tokens(n: int = 60, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB - 2) for _ in range(n)]


@pytest.mark.parametrize(
    ("build", "cls"),
    [
        (lambda: mistral_reference(13), "MistralModel"),
        (lambda: smollm3_reference(True), "SmolLM3Model"),
        (lambda: phi3_reference("long"), "Phi3Model"),
        (lambda: gemma_reference(2), "Gemma2Model"),
        (lambda: gemma_reference(3), "Gemma3Model"),
        (lambda: moe_reference("qwen3_moe"), "Qwen3MoeModel"),
        (lambda: moe_reference("olmoe"), "OlmoeModel"),
        (lambda: moe_reference("mixtral"), "MixtralModel"),
    ],
    ids=["mistral", "smollm3", "phi3", "gemma2", "gemma3", "qwen3_moe", "olmoe", "mixtral"],
)
def test_from_safetensors_is_exact(tmp_path: Path, build, cls: str) -> None:
    ref = build()
    ref.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), dtype="float32", device="cpu")
    assert type(loaded.model).__name__ == cls
    toks = tokens()
    diff = (paged_logits(loaded.model, toks, 40) - reference_logits(ref, toks)).abs().max()
    assert diff < 1e-4


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_experts_in_transformers_own_layout(tmp_path: Path, family: str) -> None:
    """A checkpoint saved with `save_original_format=False` holds each projection of a
    layer's experts as one 3-D tensor (and Mixtral's under `mlp.`): it serves the model
    its per-expert checkpoint does."""
    from safetensors import safe_open

    ref = moe_reference(family)
    ref.save_pretrained(tmp_path, save_original_format=False)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        shape = f.get_slice("model.layers.0.mlp.experts.gate_up_proj").get_shape()
    assert len(shape) == 3
    loaded = load_model(str(tmp_path), dtype="float32", device="cpu")
    toks = tokens()
    diff = (paged_logits(loaded.model, toks, 40) - reference_logits(ref, toks)).abs().max()
    assert diff < 1e-4


def test_phi3_config_in_the_older_style(tmp_path: Path) -> None:
    """A Phi-3 config.json as the Hub's carry it (rope_scaling of type `su`, rope_theta and
    partial_rotary_factor beside it) serves the model its transformers 5 config does."""
    ref = phi3_reference("long")
    ref.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(
        rope_theta=rope.pop("rope_theta"),
        partial_rotary_factor=rope.pop("partial_rotary_factor"),
        rope_scaling={**rope, "type": "su"},
    )
    config["rope_scaling"].pop("rope_type")
    config["rope_scaling"].pop("original_max_position_embeddings", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_model(str(tmp_path), dtype="float32", device="cpu")
    toks = tokens()
    diff = (paged_logits(loaded.model, toks, 40) - reference_logits(ref, toks)).abs().max()
    assert diff < 1e-4


def test_phi3_gguf(tmp_path: Path) -> None:
    """A Phi-3 file as llama.cpp writes one: q/k/v and gate/up fused, the rotary width, the
    original context, the attention factor and the window in its metadata, the LongRoPE
    factors as tensors. Dequantized it is transformers' model on the file's values;
    quantized (Q8_0), within int8 rounding of it."""
    ref = phi3_reference("long")
    path = write_gguf(ref, tmp_path / "phi3.gguf", GGMLQuantizationType.Q8_0)
    expected = dequantized_like(copy.deepcopy(ref), path)
    toks = tokens()
    oracle = reference_logits(expected, toks)
    plain = load_model(str(path), dtype="float32", device="cpu", quantization="none")
    assert type(plain.model).__name__ == "Phi3Model"
    assert plain.model.layers[0].attention.window == 20
    from_hf = Phi3Model(ref.config, torch.float32, "cpu").rotaries["global"]
    rotary = plain.model.rotaries["global"]
    assert torch.equal(rotary.inv_freq, from_hf.inv_freq)  # the long factors, 12 of 16 dims
    assert rotary.attention_scaling == pytest.approx(from_hf.attention_scaling, rel=1e-6)
    assert (paged_logits(plain.model, toks, 40) - oracle).abs().max() < 1e-4
    quantized = load_model(str(path), dtype="float32", device="cpu")
    linears = [m for m in quantized.model.modules() if isinstance(m, Linear)]
    assert all(m.quantized is not None for m in linears)
    got = paged_logits(quantized.model, toks, 40)
    assert (got - oracle).abs().mean() < 0.05 * oracle.std()
    assert (got.argmax(-1) == oracle.argmax(-1)).float().mean() >= 0.8
    assert torch.equal(
        quantized.model.rotaries["global"].inv_freq, plain.model.rotaries["global"].inv_freq
    )


def test_smollm3_gguf(tmp_path: Path) -> None:
    """A SmolLM3 file as llama.cpp writes one: Llama's layout with Q/K permuted, and no
    metadata for the layers without RoPE, which are every fourth by the architecture's
    rule. Dequantized it is transformers' model on the file's values; quantized (Q8_0),
    within int8 rounding of it; its tokenizer comes from the file."""
    torch.manual_seed(7)
    config = SmolLM3Config(
        **{**SMALL, "num_hidden_layers": 4},
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    )
    ref = SmolLM3ForCausalLM(config).eval()
    assert ref.config.no_rope_layers == [1, 1, 1, 0]
    path = write_gguf(ref, tmp_path / "smollm3.gguf", GGMLQuantizationType.Q8_0)
    expected = dequantized_like(copy.deepcopy(ref), path)
    toks = tokens()
    oracle = reference_logits(expected, toks)
    plain = load_model(str(path), dtype="float32", device="cpu", quantization="none")
    assert type(plain.model).__name__ == "SmolLM3Model"
    assert (paged_logits(plain.model, toks, 40) - oracle).abs().max() < 1e-4
    quantized = load_model(str(path), dtype="float32", device="cpu")
    assert all(m.quantized is not None for m in quantized.model.modules() if isinstance(m, Linear))
    got = paged_logits(quantized.model, toks, 40)
    assert (got - oracle).abs().mean() < 0.05 * oracle.std()
    assert (got.argmax(-1) == oracle.argmax(-1)).float().mean() >= 0.8
    tokenizer = gguf_file.load_tokenizer(path, tmp_path / "cache")
    assert tokenizer.decode(tokenizer("Hello there").input_ids) == "Hello there"


def test_gemma3_config_in_the_older_style(tmp_path: Path) -> None:
    """A Gemma 3 config.json as the Hub's carry it (rope_theta, rope_local_base_freq,
    rope_scaling for the global layers, sliding_window_pattern and no layer_types) serves
    the model its transformers 5 config does."""
    ref = gemma_reference(3)
    ref.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    del config["layer_types"]
    config.update(
        rope_theta=rope["full_attention"]["rope_theta"],
        rope_local_base_freq=rope["sliding_attention"]["rope_theta"],
        rope_scaling={"rope_type": "linear", "factor": rope["full_attention"]["factor"]},
        sliding_window_pattern=3,
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_model(str(tmp_path), dtype="float32", device="cpu")
    toks = tokens()
    diff = (paged_logits(loaded.model, toks, 40) - reference_logits(ref, toks)).abs().max()
    assert diff < 1e-4


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K])
def test_gemma_gguf(tmp_path: Path, version: int, qtype: GGMLQuantizationType) -> None:
    """A Gemma file as llama.cpp writes one: norms as 1 + w, the caps (and Gemma 3's linear
    rope scaling) in its metadata. Dequantized it is transformers' model on the file's
    values; quantized, within int8 rounding of it."""
    ref = gemma_for_gguf(version)
    path = write_gguf(ref, tmp_path / f"gemma{version}.gguf", qtype)
    expected = dequantized_like(copy.deepcopy(ref), path)
    toks = tokens()
    oracle = reference_logits(expected, toks)
    plain = load_model(str(path), dtype="float32", device="cpu", quantization="none")
    assert type(plain.model).__name__ == f"Gemma{version}Model"
    assert (paged_logits(plain.model, toks, 40) - oracle).abs().max() < 1e-4
    quantized = load_model(str(path), dtype="float32", device="cpu")
    linears = [m for m in quantized.model.modules() if isinstance(m, Linear)]
    assert all(m.quantized is not None for m in linears)
    got = paged_logits(quantized.model, toks, 40)
    assert (got - oracle).abs().mean() < 0.075 * oracle.std()
    assert (got.argmax(-1) == oracle.argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "mixtral"])
@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K])
def test_experts_gguf(tmp_path: Path, family: str, qtype: GGMLQuantizationType) -> None:
    """Qwen3-MoE, OLMoE and Mixtral files as llama.cpp writes them (OLMoE's config read
    from the metadata, Mixtral's a `llama` file with an expert count): each projection of
    a layer's experts one 3-D tensor of blocks, the router float32. Dequantized it is
    transformers' model on the file's values; quantized, every expert keeps its own
    blocks and the model is within int8 rounding of it; its tokenizer comes from the
    file."""
    ref = moe_for_gguf(family)
    path = write_gguf(ref, tmp_path / f"{family}.gguf", qtype)
    expected = dequantized_like(copy.deepcopy(ref), path)
    toks = tokens()
    oracle = reference_logits(expected, toks)
    plain = load_model(str(path), dtype="float32", device="cpu", quantization="none")
    assert type(plain.model).__name__ == type(ref).__name__.replace("ForCausalLM", "Model")
    assert all(hasattr(layer, "moe") for layer in plain.model.layers)
    assert (paged_logits(plain.model, toks, 40) - oracle).abs().max() < 1e-4
    quantized = load_model(str(path), dtype="float32", device="cpu")
    experts = [e for layer in quantized.model.layers for e in layer.moe.experts]
    assert len(experts) == 3 * 8
    for expert in experts:
        for linear in (expert.gate_up_proj, expert.down_proj):
            assert linear.quantized is not None
            assert linear.quantized.weight.source == qtype.name
    assert all(layer.moe.gate.quantized is None for layer in quantized.model.layers)
    got = paged_logits(quantized.model, toks, 40)
    assert (got - oracle).abs().mean() < 0.075 * oracle.std()
    assert (got.argmax(-1) == oracle.argmax(-1)).float().mean() >= 0.8
    tokenizer = gguf_file.load_tokenizer(path, tmp_path / "cache")
    assert tokenizer.decode(tokenizer("Hello there").input_ids) == "Hello there"
