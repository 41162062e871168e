"""Random prompts (checked with the real GPT-2 tokenizer) and the arrival schedule."""

from __future__ import annotations

import numpy as np
import pytest

from flowllm.bench.prompts import (
    WORDS,
    PromptError,
    allowed_token_ids,
    random_lengths,
    random_prompts,
)
from flowllm.bench.serve import arrival_offsets


def test_word_prompts_have_the_asked_lengths_and_follow_the_seed() -> None:
    prompts = random_prompts(20, 37, 9, seed=3)
    assert [len(p.text.split()) for p in prompts] == [37] * 20
    assert all(p.prompt_len == 37 and p.output_len == 9 for p in prompts)
    assert all(word in WORDS for p in prompts for word in p.text.split())
    assert random_prompts(20, 37, 9, seed=3) == prompts
    assert random_prompts(20, 37, 9, seed=4) != prompts
    assert len({p.text for p in prompts}) == 20


def test_range_ratio_bounds_the_lengths() -> None:
    rng = np.random.default_rng(0)
    lengths = random_lengths(rng, 100, 0.5, 2000)
    assert min(lengths) >= 50 and max(lengths) <= 150
    assert min(lengths) < 60 and max(lengths) > 140  # the whole range is used
    prompts = random_prompts(50, 40, 20, seed=1, range_ratio=0.25)
    assert all(30 <= p.prompt_len <= 50 and 15 <= p.output_len <= 25 for p in prompts)
    assert all(p.prompt_len == len(p.text.split()) for p in prompts)


@pytest.mark.parametrize(
    ("mean", "ratio"), [(0, 0.0), (10, -0.1), (10, 1.0)], ids=["zero", "negative", "one"]
)
def test_bad_lengths_are_refused(mean: int, ratio: float) -> None:
    with pytest.raises(PromptError):
        random_lengths(np.random.default_rng(0), mean, ratio, 3)


def test_every_word_is_one_gpt2_token(gpt2_tokenizer) -> None:
    # The word list's promise: with its leading space, each word is one GPT-2 token.
    multi = [w for w in WORDS if len(gpt2_tokenizer.encode(" " + w)) != 1]
    assert multi == []
    text = random_prompts(1, 200, 1, seed=0)[0].text
    assert len(gpt2_tokenizer.encode(text)) == 200


def test_token_prompts_reencode_to_the_asked_length(gpt2_tokenizer) -> None:
    prompts = random_prompts(12, 64, 8, seed=5, tokenizer=gpt2_tokenizer)
    for p in prompts:
        ids = gpt2_tokenizer.encode(p.text, add_special_tokens=False)
        assert p.prompt_len == len(ids)
        assert abs(p.prompt_len - 64) <= 2
        assert gpt2_tokenizer.eos_token_id not in ids
    assert sum(p.prompt_len == 64 for p in prompts) >= 10
    assert random_prompts(12, 64, 8, seed=5, tokenizer=gpt2_tokenizer) == prompts


def test_allowed_ids_exclude_special_tokens(gpt2_tokenizer) -> None:
    allowed = allowed_token_ids(gpt2_tokenizer)
    assert allowed.size == gpt2_tokenizer.vocab_size - 1
    assert gpt2_tokenizer.eos_token_id not in set(allowed.tolist())


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_offsets(5, None, 1.0, seed=0) == [0.0] * 5


def test_poisson_arrivals_have_the_asked_rate_and_follow_the_seed() -> None:
    offsets = arrival_offsets(4001, 50.0, 1.0, seed=7)
    assert offsets[0] == 0.0
    gaps = np.diff(offsets)
    assert np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 50.0, rel=0.08)
    # Exponential gaps: the coefficient of variation is 1.
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)
    assert arrival_offsets(4001, 50.0, 1.0, seed=7) == offsets
    assert arrival_offsets(4001, 50.0, 1.0, seed=8) != offsets


def test_burstiness_changes_the_spread_not_the_rate() -> None:
    gaps = np.diff(arrival_offsets(4001, 50.0, 4.0, seed=7))
    assert gaps.mean() == pytest.approx(1 / 50.0, rel=0.08)
    # Gamma with shape k: coefficient of variation 1 / sqrt(k) = 0.5.
    assert gaps.std() / gaps.mean() == pytest.approx(0.5, rel=0.1)
