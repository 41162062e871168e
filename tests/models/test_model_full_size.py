"""Full-size models against transformers on the same weights (fp32): the GPT-2 124M shape
and the bundled SmolLM2-135M. One step mixing prefills with decodes matches the logits of
computing from scratch, and greedy 32-token continuations of 8 prompts of different
lengths, batched, equal transformers `generate`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from model_test_utils import Blocks, PagedSeq, reference_logits, schedule
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from flowllm.models.kv_cache import KVCacheSpec
from flowllm.models.registry import model_class_for
from flowllm.models.runner import ModelRunner

pytestmark = pytest.mark.slow

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


@dataclass
class Pair:
    """Our model and transformers' on the same checkpoint, plus its tokenizer."""

    ours: Any
    ref: torch.nn.Module
    prompts: list[list[int]]

    def runner(self, num_blocks: int = 64) -> ModelRunner:
        kv = KVCacheSpec.for_model(self.ours, BLOCK).allocate(num_blocks, "cpu")
        return ModelRunner(self.ours, kv, BLOCK, "cpu")


def load_pair(model_dir: Path) -> Pair:
    config = AutoConfig.from_pretrained(model_dir)
    ours = model_class_for(config)(config, torch.float32, "cpu")
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(f))
    ours.load_weights(weights.items())
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert len({len(p) for p in prompts}) > 4  # lengths really differ
    return Pair(ours, ref, prompts)


@pytest.fixture(scope="module")
def gpt2_pair(gpt2_124m_dir: Path) -> Iterator[Pair]:
    yield load_pair(gpt2_124m_dir)


@pytest.fixture(scope="module")
def smollm2_pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    try:
        smollm2_dir = request.getfixturevalue("smollm2_dir")
    except pytest.FixtureLookupError:
        pytest.skip("the smollm2_dir fixture (tests/conftest.py) does not exist yet")
    yield load_pair(Path(smollm2_dir))


def check_mixed_step(pair: Pair, tol: float) -> None:
    """Step 1 prefills prompts 0-3; step 2 decodes 0-2 beside the prefills of prompts 4-6
    and the second half of prompt 3 after its cached first half."""
    runner, blocks = pair.runner(), Blocks(64)
    seqs = [PagedSeq(i, [*p, 13, 17]) for i, p in enumerate(pair.prompts)]
    rows: list[tuple[int, int, torch.Tensor]] = []  # (seq, position, logits)

    def step(plan: list[tuple[int, int]]) -> None:
        logits, prompt = runner.run(
            [schedule(seqs[i], n, blocks, BLOCK) for i, n in plan], {i for i, _ in plan}
        )
        for i, n in plan:
            rows.extend((i, seqs[i].num_computed + k, prompt[i][k]) for k in range(n))
            seqs[i].num_computed += n
        for (i, _), row in zip(plan, logits, strict=True):  # sampling row = last prompt row
            torch.testing.assert_close(row, prompt[i][-1], rtol=0, atol=0)

    half = len(pair.prompts[3]) // 2
    step([(i, len(pair.prompts[i])) for i in range(3)] + [(3, half)])
    step([(0, 1), (4, len(pair.prompts[4])), (1, 1), (3, len(seqs[3].tokens) - half - 2)])
    step([(5, len(pair.prompts[5])), (2, 1), (6, len(pair.prompts[6])), (0, 1), (3, 1)])
    oracle = {i: reference_logits(pair.ref, s.tokens) for i, s in enumerate(seqs)}
    worst = max((row - oracle[i][pos]).abs().max().item() for i, pos, row in rows)
    assert worst <= tol, f"max |logit difference| {worst:.2e} > {tol}"


def greedy_ours(pair: Pair) -> list[list[int]]:
    runner, blocks = pair.runner(), Blocks(64)
    seqs = [PagedSeq(i, list(p)) for i, p in enumerate(pair.prompts)]
    out: list[list[int]] = [[] for _ in seqs]
    while len(out[0]) < NEW_TOKENS:
        # Step 1 prefills every prompt; each later step decodes the 8 sequences together.
        step = [schedule(s, len(s.tokens) - s.num_computed, blocks, BLOCK) for s in seqs]
        logits, _ = runner.run(step)
        for s, row in zip(seqs, logits, strict=True):
            s.num_computed = len(s.tokens)
            s.tokens.append(int(row.argmax()))
            out[s.seq_id].append(s.tokens[-1])
    return out


def greedy_transformers(pair: Pair) -> list[list[int]]:
    pair.ref.generation_config.eos_token_id = None  # exactly NEW_TOKENS, as ignore_eos
    width = max(len(p) for p in pair.prompts)
    ids = torch.zeros(len(pair.prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(pair.prompts):  # left padding, as decoder-only batching needs
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.no_grad():
        gen = pair.ref.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return gen[:, width:].tolist()


def check_greedy(pair: Pair) -> None:
    ours, want = greedy_ours(pair), greedy_transformers(pair)
    for i, (a, b) in enumerate(zip(ours, want, strict=True)):
        assert a == b, f"prompt {i} ({PROMPTS[i]!r}): ours {a} vs transformers {b}"


def test_gpt2_124m_mixed_step_matches_transformers(gpt2_pair: Pair) -> None:
    check_mixed_step(gpt2_pair, 1e-4)


def test_gpt2_124m_greedy_matches_transformers(gpt2_pair: Pair) -> None:
    check_greedy(gpt2_pair)


def test_smollm2_mixed_step_matches_transformers(smollm2_pair: Pair) -> None:
    check_mixed_step(smollm2_pair, 1e-3)


def test_smollm2_greedy_matches_transformers(smollm2_pair: Pair) -> None:
    check_greedy(smollm2_pair)
