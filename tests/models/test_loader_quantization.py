"""`--quantization int8`: a float checkpoint's linear layers (but the LM head) quantized to
int8 per output channel at load, against transformers on the same values."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import pytest
import torch
from model_test_utils import paged_logits, reference_logits
from test_loader_gguf import tokens
from test_model_equivalence import llama_reference

from flowllm.config import ConfigError, ModelConfig
from flowllm.engine.args import add_engine_arguments, config_from_args
from flowllm.kernels.quant_linear import int8_per_channel
from flowllm.models.layers import Linear
from flowllm.models.loader import load_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: what auto picks
def test_int8_weights_against_transformers_on_their_values(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    ref = llama_reference("gqa_untied")
    ref.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), dtype, "cpu", quantization="int8")
    model = loaded.model
    quantized = [m for m in model.modules() if isinstance(m, Linear) and m.quantized]
    assert len(quantized) == 4 * len(model.layers)  # qkv, o, gate_up, down; not the head
    assert model.lm_head.quantized is None
    assert {m.quantized.weight.source for m in quantized} == {"int8"}
    # The reference: transformers with each linear weight rounded as int8 per channel.
    expected = copy.deepcopy(ref)
    with torch.no_grad():
        for name, p in expected.named_parameters():
            if name.endswith("proj.weight"):
                p.copy_(int8_per_channel(p).dequantize())
    toks = tokens(48)
    oracle = reference_logits(expected, toks)
    got = paged_logits(model, toks, 40)
    assert (got - oracle).abs().mean() < 0.075 * oracle.std()
    assert (got.argmax(-1) == oracle.argmax(-1)).float().mean() >= 0.9
    # int8 codes take a quarter of the float32 weights' bytes (plus a scale per row).
    for m in quantized:
        assert m.weight_bytes == m.out_features * (m.in_features + 4)


def test_the_flag_and_its_bounds() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, model_optional=True)
    config = config_from_args(parser.parse_args(["some/dir", "--quantization", "int8"]))
    assert config.model.quantization == "int8"
    assert config_from_args(parser.parse_args([])).model.quantization == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "fp4"])
    with pytest.raises(ConfigError, match="quantization must be one of"):
        ModelConfig(quantization="fp4")
