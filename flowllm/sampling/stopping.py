"""Token-level stop rules: when does a sampled token end its sequence?

One pure function, applied to every sampled token, so the scheduler, the sampler and the
tests agree on a single reading of max_tokens, max_model_len, EOS, stop_token_ids and
min_tokens. Stop *strings* need text and live in the detokenizer.

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
from collections.abc import Container, Iterable

from flowllm.messages import FinishReason, SamplingParams


def check_stop(
    params: SamplingParams,
    token_id: int,
    eos_token_ids: Container[int],
    num_output_tokens: int,
    total_len: int,
    max_model_len: int | None,
) -> tuple[FinishReason | None, int | None]:
    """Return (finish_reason, stop_reason) for a just-sampled token, (None, None) to go on.

    `num_output_tokens` counts the outputs including `token_id`; `total_len` is the prompt
    length plus that count. `max_model_len=None` means no context limit (tests, or a model
    without one); `params.max_tokens=None` means up to the context limit.
    """
    length_hit = (params.max_tokens is not None and num_output_tokens >= params.max_tokens) or (
        max_model_len is not None and total_len >= max_model_len
    )
    if num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token_id in eos_token_ids:
            return "stop", None
        if token_id in params.stop_token_ids:
            return "stop", token_id
    if length_hit:
        return "length", None
    return None, None


class StopChecker:
    """`check_stop` for one sequence, its fixed arguments folded in once.

    The sampler calls it for every sampled token of every sequence, so the per-token work
    is two integer comparisons and one set lookup. For every token and output count it
    returns exactly what `check_stop(params, token_id, eos_token_ids, n, num_prompt_tokens
    + n, max_model_len)` returns.
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
        # output count from which a length limit holds: prompt + n >= max_model_len
        limit = math.inf if params.max_tokens is None else params.max_tokens
        if max_model_len is not None:
            limit = min(limit, max_model_len - num_prompt_tokens)
        self.length_limit = limit

    def __call__(
        self, token_id: int, num_output_tokens: int
    ) -> tuple[FinishReason | None, int | None]:
        """(finish_reason, stop_reason) for a token that makes `num_output_tokens` outputs."""
        if num_output_tokens >= self.min_tokens and token_id in self.stopping_ids:
            return ("stop", None) if token_id in self.eos else ("stop", token_id)
        if num_output_tokens >= self.length_limit:
            return "length", None
        return None, None
