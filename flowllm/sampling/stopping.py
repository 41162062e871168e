"""Token-level stop rules: when does a sampled token end its sequence?

Written once, here, and applied by the sample stage to every sampled token (`StopRule`),
so that schedule and detokenize read the verdict off the token (`SampledToken.
finish_reason`) instead of deciding again. Stop *strings* need text: detokenize applies
them (`flowllm.text.detokenizer`). The scheduler's length guard is `output_limit` below,
the same limit the rule uses.

The rules, in order:

1. Before `min_tokens` outputs exist, only the length limits can end a sequence.
   (The sampler also masks EOS and stop_token_ids out of the logits while
   `num_output_tokens < min_tokens`, so in practice such tokens are not sampled then.)
2. EOS (unless `ignore_eos`) ends it with ("stop", None): the model chose to stop, so it
   wins over a length limit reached by the same token.
3. A token in `stop_token_ids` ends it with ("stop", token_id).
4. `max_tokens` outputs, or a total length (prompt + outputs) of `max_model_len`, end it
   with ("length", None): there is no room or no budget for another token.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from flowllm.messages import FinishReason, SamplingParams


def output_limit(
    params: SamplingParams, num_prompt_tokens: int, max_model_len: int | None
) -> float:
    """The output count at which rule 4 ends a sequence: `max_tokens` (None: unbounded),
    or fewer when the context (`max_model_len`, None: no limit) fills first."""
    limit = math.inf if params.max_tokens is None else params.max_tokens
    if max_model_len is not None:
        limit = min(limit, max_model_len - num_prompt_tokens)
    return limit


class StopRule:
    """The stop rules for one sequence, its fixed arguments folded in once.

    The sampler calls it for every sampled token of every sequence, so the per-token work
    is two integer comparisons and one set lookup.
    """

    __slots__ = ("eos", "length_limit", "min_tokens", "stopping_ids")

    def __init__(
        self,
        params: SamplingParams,
        eos_token_ids: Iterable[int],
        num_prompt_tokens: int,
        max_model_len: int | None,
    ) -> None:
        self.eos = frozenset(()) if params.ignore_eos else frozenset(eos_token_ids)
        self.stopping_ids = self.eos | frozenset(params.stop_token_ids)  # EOS and stop ids
        self.min_tokens = params.min_tokens
        self.length_limit = output_limit(params, num_prompt_tokens, max_model_len)

    def __call__(
        self, token_id: int, num_output_tokens: int
    ) -> tuple[FinishReason | None, int | None]:
        """(finish_reason, stop_reason) for a token that makes `num_output_tokens` outputs;
        (None, None) to go on."""
        if num_output_tokens >= self.min_tokens and token_id in self.stopping_ids:
            return ("stop", None) if token_id in self.eos else ("stop", token_id)
        if num_output_tokens >= self.length_limit:
            return "length", None
        return None, None
