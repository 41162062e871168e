"""Speculative decoding's parts, each against an oracle: prompt lookup against a plain
search, the scheduler's draft budget and rollback, the sampler's verification against
sampling token by token (greedy, penalties, stops, logprobs) and, for sampled requests,
the target distribution itself (chi-square over many seeded sequences), the config's
errors and the metrics."""

from __future__ import annotations

import math
from collections import Counter

import msgspec
import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from flowllm.config import (
    CacheConfig,
    ConfigError,
    SchedulerConfig,
    SpeculativeConfig,
    engine_config,
    speculative_config,
)
from flowllm.messages import (
    ReasoningTokens,
    SampledToken,
    SampledTokens,
    SamplingParams,
    SeqStart,
    StepTokens,
    StructuredOutputs,
    TokenizedRequest,
)
from flowllm.metrics import EngineMetrics, MetricsView
from flowllm.sampling.ngram import TokenLog, propose
from flowllm.sampling.sampler import Sampler
from flowllm.scheduling.scheduler import Scheduler

EOS = 0

# ------------------------------------------------------------------------- prompt lookup


def lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> tuple[int, ...]:
    """The rule in plain Python: the longest suffix n-gram (max_n down to min_n) seen
    earlier with a token after it; its earliest occurrence's next k tokens."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n :]
        for i in range(total - n):
            if tokens[i : i + n] == suffix:
                return tuple(tokens[i + n : i + n + k])
    return ()


def test_prompt_lookup_takes_the_longest_ngram_and_its_earliest_occurrence() -> None:
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 4, 7, 1, 2, 3, 4]
    assert propose(np.array(tokens), 4, 2, 4) == (9, 1, 2, 3)
    # only a 2-gram matches: its earliest occurrence, and never past the end
    assert propose(np.array([5, 6, 7, 8, 5, 6]), 4, 2, 4) == (7, 8, 5, 6)
    assert propose(np.array([5, 6, 7, 5, 6]), 4, 2, 4) == (7, 5, 6)
    assert propose(np.array([5, 6, 7, 5, 6]), 2, 2, 4) == (7, 5)
    assert propose(np.array([1, 2, 3, 1]), 4, 2, 4) == ()  # a 1-gram is below min_n
    assert propose(np.array([1, 2, 3, 1]), 4, 1, 4) == (2, 3, 1)
    assert propose(np.array([3]), 4, 1, 4) == ()


def test_prompt_lookup_equals_the_plain_search_on_random_sequences() -> None:
    rng = np.random.default_rng(0)
    for _ in range(400):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 40))).tolist()
        k, min_n = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 3))
        assert propose(np.array(tokens), k, min_n, max_n) == lookup(tokens, k, min_n, max_n)


def test_token_log_grows_past_its_first_capacity() -> None:
    log = TokenLog(tuple(range(300)))
    for t in range(300, 1000):
        log.append(t)
    assert log.ids.tolist() == list(range(1000))


# ------------------------------------------------------------------------- scheduler


def scheduler(
    max_model_len: int = 64, budget: int = 64, block_size: int = 4, **spec: int
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget),
        CacheConfig(block_size=block_size),
        num_blocks=64,
        max_model_len=max_model_len,
        speculative=SpeculativeConfig(**spec),  # type: ignore[arg-type]
    )


def add(sched: Scheduler, request_id: str, prompt: list[int], max_tokens: int = 100) -> None:
    sched.add_request(
        TokenizedRequest(
            request_id=request_id,
            prompt_token_ids=tuple(prompt),
            params=SamplingParams(max_tokens=max_tokens),
            eos_token_ids=(EOS,),
            arrival_time=0.0,
        )
    )


def tokens_of(
    step_id: int, runs: dict[int, list[int]], drafts: dict[int, tuple[int, ...]]
) -> StepTokens:
    return StepTokens(
        step_id=step_id,
        sampled=SampledTokens.of(
            tuple(SampledToken(seq_id=s, token_id=t) for s, run in runs.items() for t in run)
        ),
        drafts=drafts,
    )


def test_drafts_verified_are_reported_by_the_step_that_verified_them_only() -> None:
    """A later step that samples nothing (here, one that only releases) reports no
    verified drafts, so the metrics count each verification once."""
    sched = scheduler()
    add(sched, "a", [1, 2, 3, 4, 5])
    batch = sched.schedule()
    assert batch is not None
    sched.apply(tokens_of(batch.step_id, {0: [6]}, {0: (7, 8, 9)}))
    batch = sched.schedule()
    assert batch is not None
    sched.apply(tokens_of(batch.step_id, {0: [7, 10]}, {}))
    assert sched.verified == [(3, 1)]
    sched.abort_request("a")
    batch = sched.schedule()
    assert batch is not None and not batch.rows and batch.released == (0,)
    sched.apply(tokens_of(batch.step_id, {}, {}))
    assert sched.verified == []


def test_drafts_run_after_the_last_token_and_rejected_ones_roll_back() -> None:
    sched = scheduler()
    add(sched, "a", [1, 2, 3, 4, 5])
    batch = sched.schedule()
    assert batch is not None and batch.rows[0].num_draft_tokens == 0
    sched.apply(tokens_of(batch.step_id, {0: [6]}, {0: (7, 8, 9)}))
    batch = sched.schedule()
    assert batch is not None
    (row,) = batch.rows
    assert (row.token_ids, row.num_computed_tokens, row.num_draft_tokens, row.sample) == (
        (6, 7, 8, 9), 5, 3, True,
    )  # fmt: skip
    assert len(row.block_table) * 4 >= 9  # room for every draft's K/V
    # the first draft accepted, the second rejected: 7 and the target's 10 come back
    sched.apply(tokens_of(batch.step_id, {0: [7, 10]}, {}))
    seq = sched.get_sequence(0)
    assert seq is not None
    assert seq.token_ids == [1, 2, 3, 4, 5, 6, 7, 10]
    assert seq.num_computed_tokens == 7  # 8 and 9 were wrong: 10 is computed next
    assert sched.verified == [(3, 1)]
    batch = sched.schedule()
    assert batch is not None
    assert (batch.rows[0].token_ids, batch.rows[0].num_computed_tokens) == ((10,), 7)
    # the block the rejected drafts reached stays the sequence's, for its next tokens
    assert batch.rows[0].block_table == row.block_table
    assert len(row.block_table) == 3


def test_drafts_stay_within_the_budget_the_length_limit_and_max_model_len() -> None:
    def drafts_scheduled(prompt_len: int, max_tokens: int, max_model_len: int, budget: int) -> int:
        sched = scheduler(max_model_len=max_model_len, budget=budget)
        add(sched, "a", list(range(1, prompt_len + 1)), max_tokens=max_tokens)
        add(sched, "b", [1, 2])
        batch = sched.schedule()
        assert batch is not None
        sched.apply(tokens_of(batch.step_id, {0: [9], 1: [9]}, {0: (1, 2, 3, 4)}))
        batch = sched.schedule()
        assert batch is not None
        assert sum(len(s.token_ids) for s in batch.rows) <= budget
        return batch.rows[0].num_draft_tokens

    assert drafts_scheduled(5, 100, 64, 64) == 4
    assert drafts_scheduled(5, 3, 64, 64) == 1  # 1 output so far: 2 more, the last sampled
    assert drafts_scheduled(5, 2, 64, 64) == 0
    # max_model_len 8: 3 outputs at most, so 1 draft (and no position reaches 8)
    assert drafts_scheduled(5, 100, 8, 64) == 1
    assert drafts_scheduled(1, 100, 64, 3) == 1  # b keeps its one token of the budget


def test_a_large_batch_steps_aside_and_a_constraint_after_reasoning_takes_no_drafts() -> None:
    def drafts_scheduled(sched: Scheduler, **params: object) -> list[int]:
        for request_id in ("a", "b"):
            sched.add_request(
                TokenizedRequest(
                    request_id=request_id,
                    prompt_token_ids=(1, 2, 3),
                    params=SamplingParams(**params),  # type: ignore[arg-type]
                    eos_token_ids=(EOS,),
                    arrival_time=0.0,
                )
            )
        batch = sched.schedule()
        assert batch is not None
        sched.apply(tokens_of(batch.step_id, {0: [4], 1: [4]}, {0: (5,), 1: (5,)}))
        batch = sched.schedule()
        assert batch is not None
        return [s.num_draft_tokens for s in batch.rows]

    assert drafts_scheduled(scheduler(disable_by_batch_size=2)) == [1, 1]
    assert drafts_scheduled(scheduler(disable_by_batch_size=1)) == [0, 0]
    regex = StructuredOutputs(regex="[0-9]+")
    assert drafts_scheduled(scheduler(), structured_outputs=regex) == [1, 1]
    tags = ReasoningTokens(start=10, end=11, opens_inside=False)
    after = msgspec.structs.replace(regex, after_reasoning=tags)
    assert drafts_scheduled(scheduler(), structured_outputs=after) == [0, 0]


# ------------------------------------------------------------------------- sampler


def start(
    sampler: Sampler, seq_id: int, params: SamplingParams, prompt: tuple[int, ...] = (1, 2, 3)
) -> None:
    sampler.start(
        SeqStart(
            seq_id=seq_id,
            request_id=f"r{seq_id}",
            index=0,
            params=params,
            prompt_token_ids=prompt,
            eos_token_ids=(EOS,),
        )
    )


def one_by_one(
    params: SamplingParams, rows: torch.Tensor, drafts: tuple[int, ...]
) -> list[SampledToken]:
    """The oracle: sample row by row, each after the previous token, stopping at the first
    token that differs from the draft (or ends the sequence)."""
    sampler = Sampler()
    start(sampler, 0, params)
    out = []
    for j in range(len(drafts) + 1):
        (token,) = sampler.sample([0], rows[j : j + 1], [j])
        out.append(token)
        if token.finish_reason is not None or j == len(drafts) or token.token_id != drafts[j]:
            break
    return out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=50),
        SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=1.0,
                       frequency_penalty=0.5, max_tokens=50),
        SamplingParams(temperature=0.0, min_tokens=3, max_tokens=50, logprobs=2),
        SamplingParams(temperature=0.0, stop_token_ids=(5,), max_tokens=50),
        SamplingParams(temperature=0.0, max_tokens=3),
        SamplingParams(temperature=0.8, seed=7, max_tokens=50, logprobs=1),
        SamplingParams(temperature=1.2, seed=8, top_k=4, repetition_penalty=1.3, max_tokens=50),
    ],
    ids=["greedy", "penalties", "min_tokens+logprobs", "stop_id", "max_tokens", "seeded",
         "seeded+top_k+penalty"],
)  # fmt: skip
def test_verification_equals_sampling_token_by_token(params: SamplingParams) -> None:
    """Greedy or seeded, the tokens verification keeps are those sampling one token at a
    time gives: the drafts equal to them, then the first that differs."""
    gen = torch.Generator().manual_seed(0)
    vocab = 12
    for trial in range(60):
        rows = torch.randn(5, vocab, generator=gen) * 2
        # drafts: each row's plain argmax, some changed, so runs end at every position
        drafts = [int(t) for t in rows[:4].argmax(dim=-1)]
        if trial % 3:
            drafts[trial % 4] = (drafts[trial % 4] + 1) % vocab
        if trial % 5 == 0:
            drafts[1] = EOS
        sampler = Sampler()
        start(sampler, 0, params)
        got = sampler.verify([0], [tuple(drafts)], rows, [0])
        assert list(got) == one_by_one(params, rows, tuple(drafts)), trial


def test_verification_keeps_each_sequence_in_order_in_a_batch() -> None:
    sampler = Sampler()
    for seq_id in range(3):
        start(sampler, seq_id, SamplingParams(temperature=0.0))
    rows = torch.full((1 + 4 + 2, 6), -5.0)
    for row, best in enumerate([4, 1, 2, 3, 5, 2, 2]):
        rows[row, best] = 5.0
    # seq 0: no drafts; seq 1: drafts (1, 2, 0): two accepted, then the target's 3;
    # seq 2: draft (2,): accepted, then the bonus token 2
    got = sampler.verify([0, 1, 2], [(), (1, 2, 0), (2,)], rows, [0, 0, 0])
    assert [(t.seq_id, t.token_id) for t in got] == [
        (0, 4), (1, 1), (1, 2), (1, 3), (2, 2), (2, 2),
    ]  # fmt: skip


def test_each_verified_position_draws_under_its_own_mask() -> None:
    """A mask row per position: a draft its position's mask forbids is rejected even where
    the logits would pick it, and the draw there comes from the allowed tokens; an allowed
    draft is kept. Rows without a mask row are drawn from the logits alone."""
    rows = torch.full((5, 8), -5.0)
    for row, best in enumerate([1, 2, 3, 4, 5]):
        rows[row, best] = 5.0
    rows[1, 6] = 4.0  # position 1's best allowed token
    masks = torch.zeros(3, 1, dtype=torch.int32)
    masks[0, 0] = 0b11111111  # position 0: anything
    masks[1, 0] = 0b01000000  # position 1: only token 6, not the logits' 2
    masks[2, 0] = 0b11111111
    sampler = Sampler()
    start(sampler, 0, SamplingParams(temperature=0.0))
    start(sampler, 1, SamplingParams(temperature=0.0))
    # seq 0: drafts (1, 2) on rows 0-2, one mask row each; seq 1: draft (4,) on rows 3-4,
    # unmasked: its draft and the bonus token are the logits' own
    got = sampler.verify([0, 1], [(1, 2), (4,)], rows, [0, 0], ([0, 1, 2], masks))
    assert [(t.seq_id, t.token_id) for t in got] == [(0, 1), (0, 6), (1, 4), (1, 5)]
    # without the masks, seq 0 keeps both drafts
    sampler = Sampler()
    start(sampler, 0, SamplingParams(temperature=0.0))
    got = sampler.verify([0], [(1, 2)], rows[:3], [0])
    assert [t.token_id for t in got] == [1, 2, 3]


def chi_square(counts: Counter[int], expected: list[float], draws: int) -> tuple[float, int]:
    support = [t for t, q in enumerate(expected) if q > 0]
    stat = sum(
        (counts.get(t, 0) - expected[t] * draws) ** 2 / (expected[t] * draws) for t in support
    )
    return stat, len(support) - 1


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5, seed=3),
        SamplingParams(temperature=1.3, top_p=0.8, seed=4),
    ],
    ids=["plain", "top_k_seeded", "top_p_seeded"],
)
def test_rejection_sampling_keeps_the_target_distribution(params: SamplingParams) -> None:
    """Many sequences verify the same drafts against the same rows: the first token must
    follow row 0's distribution, and the second, among those that accepted the first
    draft, row 1's; whatever the drafts' own probabilities (a likely and an unlikely one).
    The first draft is kept about as often as its probability."""
    vocab, draws = 8, 20000
    rows = torch.tensor(
        [[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 0.3, 1.5], [0.1, 0.2, 2.0, -1.0, 0.0, 1.0, 0.5, -2.0],
         [0.0] * 8]
    )  # fmt: skip
    sampler = Sampler(seed=5)
    for i in range(draws):
        sampler.start(
            SeqStart(seq_id=i, request_id=f"r{i}", index=i, params=params,
                     prompt_token_ids=(1,), eos_token_ids=())
        )  # fmt: skip
    drafts = (0, 3)  # likely first, unlikely second
    got = sampler.verify(list(range(draws)), [drafts] * draws, rows.repeat(draws, 1), [0] * draws)
    runs: dict[int, list[int]] = {}
    for t in got:
        runs.setdefault(t.seq_id, []).append(t.token_id)
    expected = [target(rows[j], params) for j in range(2)]
    first = Counter(run[0] for run in runs.values())
    stat, df = chi_square(first, expected[0], draws)
    assert stat < df + 6 * math.sqrt(2 * df) + 1, (stat, first)
    after = [run[1] for run in runs.values() if run[0] == drafts[0]]
    second = Counter(after)
    stat, df = chi_square(second, expected[1], len(after))
    assert stat < df + 6 * math.sqrt(2 * df) + 1, (stat, second)
    assert all(expected[0][t] > 0 for t in first) and all(expected[1][t] > 0 for t in second)
    kept = len(after) / draws
    spread = 6 * math.sqrt(expected[0][0] * (1 - expected[0][0]) / draws)
    assert abs(kept - expected[0][0]) < spread, (kept, expected[0][0])
    assert vocab == rows.shape[1]


def target(row: torch.Tensor, p: SamplingParams) -> list[float]:
    """The distribution the sampler draws a row from: temperature, top_k, then top_p."""
    probs = torch.softmax(row.double() / p.temperature, dim=-1)
    order = torch.argsort(probs, descending=True).tolist()
    keep = set(order[: p.top_k] if p.top_k > 0 else order)
    mass, kept = 0.0, set()
    for t in order:
        if t in keep and mass < p.top_p:
            kept.add(t)
            mass += float(probs[t])
    total = sum(float(probs[t]) for t in kept)
    return [float(probs[t]) / total if t in kept else 0.0 for t in range(len(probs))]


# ------------------------------------------------------------------------- config, metrics


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ('{"method": "eagle"}',
         "speculative method must be one of ('ngram', 'draft_model'), got 'eagle'"),
        ('{"method": "draft_model"}', "model must name the draft model"),
        ('{"method": "ngram", "model": "d"}', "which method 'ngram' does not run"),
        ('{"model": "d", "dtype": "fp8"}', "dtype must be one of"),
        ('{"model": "d", "draft_kv_cache_memory": 0}', "draft_kv_cache_memory must be > 0, got 0"),
        ('{"model": "d", "draft_model": "e"}', "unknown field `draft_model`"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be in [1, 16], got 0"),
        ('{"num_speculative_tokens": 17}', "num_speculative_tokens must be in [1, 16], got 17"),
        ('{"prompt_lookup_min": 5}', "prompt_lookup_max (4) must be >= prompt_lookup_min (5)"),
        ('{"prompt_lookup_min": 0}', "prompt_lookup_min must be >= 1, got 0"),
        ('{"disable_by_batch_size": 0}', "disable_by_batch_size must be >= 1, got 0"),
        ('{"num_speculative_tokens": "4"}', "Expected `int`, got `str`"),
        ('{"k": 4}', "unknown field `k`"),
        ("{", "speculative_config:"),
    ],
)  # fmt: skip
def test_bad_speculative_configs_say_what_is_wrong(value: str, said: str) -> None:
    with pytest.raises(ConfigError) as raised:
        speculative_config(value)
    assert said in str(raised.value)
    with pytest.raises(ConfigError):
        engine_config(speculative_config=value)


def test_speculative_config_from_json_a_dict_or_itself() -> None:
    want = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=5)
    assert speculative_config('{"num_speculative_tokens": 3, "prompt_lookup_max": 5}') == want
    assert (
        engine_config(
            speculative_config={"num_speculative_tokens": 3, "prompt_lookup_max": 5}
        ).speculative
        == want
    )
    assert engine_config(speculative=want).speculative == want
    assert engine_config().speculative is None
    # a model and no method: a draft model, as vLLM infers it
    drafting = speculative_config('{"model": "small", "num_speculative_tokens": 3}')
    assert (drafting.method, drafting.model, drafting.dtype) == ("draft_model", "small", None)
    assert speculative_config("{}").method == "ngram"
    with pytest.raises(ConfigError, match="one step in flight"):
        Scheduler(
            SchedulerConfig(), CacheConfig(), 256, 64, async_scheduling=True, speculative=want
        )


def test_metrics_count_drafts_accepted_and_accepted_per_position_under_vllm_names() -> None:
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry)
    metrics.observe_verified([(4, 2), (3, 0), (4, 4)])
    metrics.observe_verified([(2, 1)])
    view = MetricsView(registry, "vllm", "m").registry()
    get = view.get_sample_value
    assert get("vllm:spec_decode_num_draft_tokens_total", {"model_name": "m"}) == 13
    assert get("vllm:spec_decode_num_accepted_tokens_total", {"model_name": "m"}) == 7
    per_pos = [
        get(
            "vllm:spec_decode_num_accepted_tokens_per_pos_total",
            {"model_name": "m", "position": str(i)},
        )
        for i in range(4)
    ]
    assert per_pos == [3, 2, 1, 1]
