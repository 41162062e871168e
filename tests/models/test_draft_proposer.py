"""The draft proposer's cache against recomputation: after any history of accepted and
rejected drafts, evictions and sequences coming and going, the drafts it proposes equal
those of a fresh proposer that computes every sequence from its first token, and a
released sequence's blocks are free again."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from flowllm.models.draft import DraftModel
from flowllm.models.draft_proposer import DraftProposer
from flowllm.models.kv_cache import KVCacheSpec
from flowllm.models.loader import load_model

VOCAB = 50257
BLOCK = 16


def draft_model(path: Path, num_blocks: int, max_len: int = 1024) -> DraftModel:
    loaded = load_model(str(path), "float32", "cpu")
    spec = KVCacheSpec.for_model(loaded.model, BLOCK)
    return DraftModel(
        loaded.model, spec.allocate(num_blocks, "cpu"), num_blocks, BLOCK, max_len, loaded.device
    )


def from_scratch(proposer: DraftProposer, tokens: np.ndarray) -> tuple[int, ...]:
    """The drafts of a proposer holding nothing of the sequence: every token computed."""
    proposer.release((0,))
    return proposer.propose({0: tokens})[0]


@pytest.mark.parametrize("num_blocks", [256, 10])
def test_incremental_drafts_equal_drafts_computed_from_scratch(
    gpt2_tiny_dir: Path, num_blocks: int
) -> None:
    """Each step a sequence accepts a random prefix of its drafts and one token more (the
    target's), or sits the step out while its tokens go on; 10 blocks hold about two of
    the sequences, so the others are evicted and catch up from their first token (or, too
    long, draft nothing)."""
    draft = draft_model(gpt2_tiny_dir, num_blocks)
    k = 4
    scratch = DraftProposer(draft_model(gpt2_tiny_dir, 256), k, 32)
    proposer = DraftProposer(draft, k, 32)  # prompts of up to 90 tokens: several passes
    rng = random.Random(num_blocks)
    seqs = {
        i: np.array([rng.randrange(VOCAB) for _ in range(rng.randint(1, 90))], dtype=np.int64)
        for i in range(4)
    }
    last: dict[int, tuple[int, ...]] = {}
    checked = 0
    for step in range(9):
        going = {i: t for i, t in seqs.items() if (i + step) % 4}  # some sit steps out
        drafts = proposer.propose(going)
        for i, tokens in going.items():
            if i in drafts:
                assert drafts[i] == from_scratch(scratch, tokens), (step, i)
                checked += 1
        for i in seqs:
            # a drafting sequence accepts a prefix of its drafts and one token more; one
            # that sat the step out decoded a few tokens meanwhile, the first of them
            # maybe its old first draft (its cache holds that draft's K/V, not the rest)
            proposed = drafts.get(i, last.get(i, ()))
            accept = rng.randint(0, len(proposed)) if i in going else min(1, len(proposed))
            more = [*proposed[:accept], *(rng.randrange(VOCAB) for _ in range(rng.randint(1, 3)))]
            seqs[i] = np.concatenate([seqs[i], np.array(more, dtype=np.int64)])
            last[i] = proposed
        if step == 4:  # one leaves, another comes
            proposer.release((0,))
            del seqs[0]
            seqs[9] = np.array([rng.randrange(VOCAB) for _ in range(40)], dtype=np.int64)
    assert checked > 12
    proposer.release(seqs)
    assert proposer.free_blocks == num_blocks and not proposer.holds()


def test_drafts_stop_at_the_drafts_context(gpt2_tiny_dir: Path) -> None:
    """A draft of 40 positions: the last draft's position stays below 40."""
    proposer = DraftProposer(draft_model(gpt2_tiny_dir, 64, max_len=40), 4, 64)
    for n, want in [(30, 4), (37, 4), (38, 3), (40, 1), (41, 0)]:
        drafts = proposer.propose({n: np.arange(n, dtype=np.int64)})
        assert len(drafts.get(n, ())) == want, n
    assert proposer.holds() == {30, 37, 38, 40}
