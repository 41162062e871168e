"""Helpers for the model tests: a tiny block allocator and step bookkeeping that drive
`ModelRunner` the way the scheduler does, random-weight transformers references, and the
small random GPT-2 and Llama that the replayed-step tests run."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from transformers import GPT2Config, LlamaConfig

from flowllm.messages import ScheduledSeq
from flowllm.models.gpt2 import GPT2Model
from flowllm.models.kv_cache import KVCacheSpec
from flowllm.models.layers import pack_linears
from flowllm.models.llama import LlamaModel
from flowllm.models.runner import ModelRunner

STEP_VOCAB = 300  # the vocabulary of `step_gpt2` and `step_llama`


def random_weights(model: torch.nn.Module) -> torch.nn.Module:
    """Fill a model with seeded random weights (norms near 1) and pack its linears."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                    else 0.2 * torch.randn(p.shape, generator=g))  # fmt: skip
    pack_linears(model)
    return model


def step_gpt2(
    dtype: torch.dtype, device: str = "cpu", positions: int = 128, activation: str = "gelu_new"
) -> GPT2Model:
    """A 2-layer GPT-2, 128 wide, with random weights."""
    cfg = GPT2Config(
        n_layer=2, n_embd=128, n_head=4, vocab_size=STEP_VOCAB, n_positions=positions,
        activation_function=activation,
    )  # fmt: skip
    return random_weights(GPT2Model(cfg, dtype, device))  # type: ignore[return-value]


def step_llama(dtype: torch.dtype, device: str = "cpu", positions: int = 128) -> LlamaModel:
    """A 3-layer Llama, 128 wide with grouped KV heads, with random weights."""
    cfg = LlamaConfig(
        num_hidden_layers=3, hidden_size=128, intermediate_size=160, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=STEP_VOCAB, max_position_embeddings=positions,
        tie_word_embeddings=False,
    )  # fmt: skip
    return random_weights(LlamaModel(cfg, dtype, device))  # type: ignore[return-value]


@dataclass
class PagedSeq:
    """One sequence's tokens, how many are in the cache, and its block table."""

    seq_id: int
    tokens: list[int]
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)


class Blocks:
    """Hands out distinct, shuffled block ids so tables are never contiguous by accident."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def grow(self, seq: PagedSeq, num_tokens: int, block_size: int) -> None:
        while len(seq.blocks) * block_size < num_tokens:
            seq.blocks.append(self.free.pop())


def schedule(
    seq: PagedSeq, n: int, blocks: Blocks, block_size: int, sample: bool = True
) -> ScheduledSeq:
    """The next `n` uncomputed tokens of `seq` as a ScheduledSeq (allocating blocks)."""
    end = seq.num_computed + n
    if end > len(seq.tokens):
        raise ValueError("scheduling past the known tokens")
    blocks.grow(seq, end, block_size)
    return ScheduledSeq(
        seq_id=seq.seq_id,
        token_ids=tuple(seq.tokens[seq.num_computed : end]),
        num_computed_tokens=seq.num_computed,
        block_table=tuple(seq.blocks),
        sample=sample,
        num_output_tokens=0,
    )


def reference_logits(ref: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """transformers' logits for every position of `tokens`, computed from scratch."""
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0].float()


def paged_logits(
    model: torch.nn.Module, tokens: list[int], prompt: int, block_size: int = 16
) -> torch.Tensor:
    """A model's logits at every position through the paged runner: a prefill of `prompt`
    tokens (with prompt logits), then one decode step per remaining token."""
    num_blocks = -(-len(tokens) // block_size)
    kv = KVCacheSpec.for_model(model, block_size).allocate(num_blocks, "cpu")
    runner = ModelRunner(model, kv, block_size, "cpu")
    seq, blocks = PagedSeq(0, tokens), Blocks(num_blocks)
    _, rows = runner.run([schedule(seq, prompt, blocks, block_size)], {0})
    out = [rows[0]]
    seq.num_computed = prompt
    while seq.num_computed < len(tokens):
        logits, _ = runner.run([schedule(seq, 1, blocks, block_size)], set())
        seq.num_computed += 1
        out.append(logits)
    return torch.cat(out)
