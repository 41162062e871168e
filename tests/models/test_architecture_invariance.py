"""Batch invariance of the architectures built on Llama's layer, served quantized as the
default serves GGUF files (and `--quantization int8` safetensors): a sequence's logits
are the same bits alone, prefilled whole, as among other sequences, its prompt chunked
beside their prefills and decodes. Sliding windows, score caps, layers without RoPE,
Gemma's norms and experts shared with other sequences' tokens all keep each row on its
own (the mixture-of-experts models also in their float weights: `auto` on safetensors)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_fixtures import gemma_for_gguf, moe_for_gguf, write_gguf
from model_test_utils import Blocks, PagedSeq, schedule
from test_model_equivalence import (
    mistral_reference,
    moe_reference,
    phi3_reference,
    smollm3_reference,
)

from flowllm.models.kv_cache import KVCacheSpec
from flowllm.models.loader import load_model
from flowllm.models.runner import ModelRunner

BLOCK = 16
Q8_0, Q4_K = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K


def from_safetensors(build: Callable[[], torch.nn.Module]) -> Callable[[Path], str]:
    def save(tmp: Path) -> str:
        build().save_pretrained(tmp)
        return str(tmp)

    return save


def from_gguf(build: Callable[[], torch.nn.Module], qtype: GGMLQuantizationType):
    def save(tmp: Path) -> str:
        return str(write_gguf(build(), tmp / "model.gguf", qtype, tokenizer=False))

    return save


MODELS = {
    "mistral": (from_safetensors(lambda: mistral_reference(13)), "int8"),
    "smollm3": (from_safetensors(lambda: smollm3_reference(True)), "int8"),
    "phi3": (from_gguf(lambda: phi3_reference("long"), Q8_0), "auto"),
    "gemma2": (from_gguf(lambda: gemma_for_gguf(2), Q4_K), "auto"),
    "gemma3": (from_gguf(lambda: gemma_for_gguf(3), Q8_0), "auto"),
    "qwen3moe": (from_gguf(lambda: moe_for_gguf("qwen3_moe"), Q4_K), "auto"),
    "mixtral_gguf": (from_gguf(lambda: moe_for_gguf("mixtral"), Q8_0), "auto"),
    "qwen3_moe_int8": (from_safetensors(lambda: moe_reference("qwen3_moe")), "int8"),
    "qwen3_moe_float": (from_safetensors(lambda: moe_reference("qwen3_moe")), "auto"),
    "olmoe": (from_safetensors(lambda: moe_reference("olmoe")), "int8"),
    "olmoe_gguf": (from_gguf(lambda: moe_for_gguf("olmoe"), Q4_K), "auto"),
    "mixtral": (from_safetensors(lambda: moe_reference("mixtral")), "auto"),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_a_sequence_alone_and_among_others_gives_the_same_bits(name: str, tmp_path: Path) -> None:
    save, quantization = MODELS[name]
    model = load_model(save(tmp_path), device="cpu", quantization=quantization).model
    kv = KVCacheSpec.for_model(model, BLOCK).allocate(64, "cpu")
    runner = ModelRunner(model, kv, BLOCK, "cpu")
    rng = random.Random(4)
    probe = [rng.randrange(500) for _ in range(48)]

    alone = PagedSeq(0, probe)
    blocks = Blocks(64)
    _, rows = runner.run([schedule(alone, 40, blocks, BLOCK)], {0})
    want = [rows[0]]
    alone.num_computed = 40
    for _ in range(8):
        logits, _ = runner.run([schedule(alone, 1, blocks, BLOCK)])
        alone.num_computed += 1
        want.append(logits[:1])

    seqs = [PagedSeq(0, probe)] + [
        PagedSeq(i, [rng.randrange(500) for _ in range(n)]) for i, n in ((1, 70), (2, 30), (3, 50))
    ]
    blocks = Blocks(64, seed=1)
    got: list[torch.Tensor] = []

    def step(plan: list[tuple[int, int]], prompt_ids: set[int]) -> None:
        scheduled = [schedule(seqs[i], n, blocks, BLOCK) for i, n in plan]
        logits, rows = runner.run(scheduled, prompt_ids)
        for i, n in plan:
            seqs[i].num_computed += n
        if 0 in rows:
            got.append(rows[0])
        elif plan[0][0] == 0:
            got.append(logits[:1])

    # The probe's prompt in chunks of 16 and 24 beside the others' prefills and decodes.
    step([(1, 20), (0, 16)], {0})
    step([(1, 1), (0, 24), (2, 9), (3, 12)], {0})
    step([(3, 21), (2, 1), (1, 1)], set())
    for _ in range(8):
        step([(0, 1), (1, 1), (2, 1), (3, 1)], set())
    got = [torch.cat(got[:2]), *got[2:]]
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"{name}: step {i} differs by {(a - b).abs().max():.3g}"
