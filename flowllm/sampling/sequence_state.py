"""What the sampler keeps about one sequence, built once from its `SeqStart`.

A read-only copy of what schedule owns (parameters, prompt, EOS ids), folded into the
forms the batched step reads: the stop rule, the min_tokens ids, the logit bias as
tensors, the slot of its generator among the sampler's `SeededUniforms` and, when a penalty
is active, the token history.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from flowllm.messages import SamplingParams, SeqStart
from flowllm.sampling.seeded_uniforms import SeededUniforms
from flowllm.stopping import StopRule

GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily
LOGIT_BIAS_LIMIT = 100.0  # logit_bias values are clamped to [-LIMIT, LIMIT]


def sibling_seed(seed: int, index: int) -> int:
    """The generator seed of choice `index` of a request seeded with `seed`.

    `seed + index` (mod 2**64), as vLLM seeds the children of an `n > 1` request: choice 0
    samples exactly like an `n = 1` request with the same seed, siblings differ from each
    other, and every choice is reproducible on its own.
    """
    return (seed + index) % 2**64


class TokenHistory:
    """Distinct tokens of the prompt and outputs, with each one's count among the outputs.

    Penalties touch only these tokens, so they cost O(distinct tokens) per step instead of
    O(vocab). Arrays grow by doubling; `pos` maps a token id to its slot.
    """

    __slots__ = ("counts", "ids", "n", "pos")

    def __init__(self, prompt_token_ids: Sequence[int]) -> None:
        distinct = list(dict.fromkeys(prompt_token_ids))
        capacity = max(16, 2 * len(distinct))
        self.ids = np.zeros(capacity, dtype=np.int64)  # [capacity], valid in [:n]
        self.counts = np.zeros(capacity, dtype=np.float32)  # output count of ids[i]
        self.ids[: len(distinct)] = distinct
        self.pos: dict[int, int] = {t: i for i, t in enumerate(distinct)}
        self.n = len(distinct)

    def add(self, token_id: int) -> None:
        i = self.pos.get(token_id)
        if i is None:
            if self.n == len(self.ids):
                self.ids = np.concatenate([self.ids, np.zeros_like(self.ids)])
                self.counts = np.concatenate([self.counts, np.zeros_like(self.counts)])
            i = self.n
            self.ids[i] = token_id
            self.pos[token_id] = i
            self.n += 1
        self.counts[i] += 1.0


@dataclass(slots=True)
class SeqSamplingState:
    """What the sampler keeps about one sequence."""

    params: SamplingParams
    prompt_token_ids: tuple[int, ...]
    stop: StopRule  # the finish reason of each sampled token
    min_tokens_ids: torch.Tensor  # [k] int64: EOS ∪ stop_token_ids, masked before min_tokens
    greedy: bool
    uniform_slot: int | None  # its generator's slot in SeededUniforms: seeded, non-greedy only
    bias_ids: torch.Tensor | None  # [k] int64
    bias_values: torch.Tensor | None  # [k] float32, clamped
    history: TokenHistory | None  # only when a penalty is active
    finished: bool = False  # a sampled token ended it (rows scheduled after are dropped)

    @classmethod
    def of(
        cls, seq: SeqStart, max_model_len: int | None, uniforms: SeededUniforms
    ) -> SeqSamplingState:
        """The state of a starting sequence; a seeded one takes a slot in `uniforms`."""
        p = seq.params
        greedy = p.temperature < GREEDY_TEMPERATURE
        slot = None
        if p.seed is not None and not greedy:
            slot = uniforms.add(sibling_seed(p.seed, seq.index))
        bias_ids = bias_values = None
        if p.logit_bias:
            bias_ids = torch.tensor(list(p.logit_bias.keys()), dtype=torch.int64)
            bias_values = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32).clamp_(
                -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT
            )
        penalized = (
            p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0
        )
        stop_ids = sorted(set(seq.eos_token_ids) | set(p.stop_token_ids))
        return cls(
            params=p,
            prompt_token_ids=seq.prompt_token_ids,
            stop=StopRule(p, seq.eos_token_ids, len(seq.prompt_token_ids), max_model_len),
            min_tokens_ids=torch.tensor(stop_ids, dtype=torch.int64),
            greedy=greedy,
            uniform_slot=slot,
            bias_ids=bias_ids,
            bias_values=bias_values,
            history=TokenHistory(seq.prompt_token_ids) if penalized else None,
        )

    @property
    def has_processor(self) -> bool:
        """May a logits processor (logit bias, penalty, min_tokens) ever touch its row?"""
        return (
            self.bias_ids is not None
            or self.history is not None
            or (self.params.min_tokens > 0 and self.min_tokens_ids.numel() > 0)
        )
