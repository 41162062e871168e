"""Greedy continuations of full-size models equal transformers `generate` (fp32): the
GPT-2 124M shape and the bundled SmolLM2, 8 prompts of different lengths in one batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_test_utils import Blocks, PagedSeq, schedule
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from flowllm.models.kv_cache import KVCacheSpec
from flowllm.models.registry import model_class_for
from flowllm.models.runner import ModelRunner

PROMPTS = [
    "The quick brown fox",
    "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole,",
    "Once upon a time",
    "def fibonacci(n):",
    "The capital of France is",
    "1, 2, 3, 4,",
    "Paged attention stores keys and values in fixed-size blocks so that",
    "Hello",
]
NEW_TOKENS = 32
BLOCK = 16


def greedy_ours(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    config = AutoConfig.from_pretrained(model_dir)
    model = model_class_for(config)(config, torch.float32, "cpu")
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(f))
    model.load_weights(weights.items())
    kv = KVCacheSpec.for_model(model, BLOCK).allocate(64, "cpu")
    runner = ModelRunner(model, kv, BLOCK, "cpu")
    blocks = Blocks(64)
    seqs = [PagedSeq(i, list(p)) for i, p in enumerate(prompts)]
    out: list[list[int]] = [[] for _ in prompts]
    while len(out[0]) < NEW_TOKENS:
        # Step 1 prefills every prompt; each later step decodes the 8 sequences together.
        step = [schedule(s, len(s.tokens) - s.num_computed, blocks, BLOCK) for s in seqs]
        logits, _ = runner.run(step)
        for s, row in zip(seqs, logits, strict=True):
            s.num_computed = len(s.tokens)
            token = int(row.argmax())
            s.tokens.append(token)
            out[s.seq_id].append(token)
    return out


def greedy_transformers(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None  # generate exactly NEW_TOKENS, as ignore_eos
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding, as decoder-only batching needs
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.no_grad():
        gen = ref.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return gen[:, width:].tolist()


def check_same_continuations(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert len({len(p) for p in prompts}) > 4  # lengths really differ
    ours = greedy_ours(model_dir, prompts)
    want = greedy_transformers(model_dir, prompts)
    for i, (a, b) in enumerate(zip(ours, want, strict=True)):
        assert a == b, f"prompt {i} ({PROMPTS[i]!r}): ours {a} vs transformers {b}"


def test_gpt2_124m_greedy_matches_transformers(gpt2_124m_dir: Path) -> None:
    check_same_continuations(gpt2_124m_dir)


def test_smollm2_greedy_matches_transformers(request: pytest.FixtureRequest) -> None:
    try:
        smollm2_dir = request.getfixturevalue("smollm2_dir")
    except pytest.FixtureLookupError:
        pytest.skip("the smollm2_dir fixture (tests/conftest.py) does not exist yet")
    check_same_continuations(Path(smollm2_dir))
