"""Scheduler policy: token budget, chunked prefill, decode-first without starvation,
preemption by recompute with prefix-cache hits, abort, finishing, n > 1 sharing."""

from __future__ import annotations

import msgspec
import pytest

from flowllm.config import CacheConfig, ConfigError, SchedulerConfig
from flowllm.messages import (
    FinishReason,
    SampledToken,
    SampledTokens,
    SamplingParams,
    StepBatch,
    StepTokens,
    TokenizedRequest,
)
from flowllm.scheduling.scheduler import Scheduler, SchedulerError
from flowllm.scheduling.sequence import Sequence, SequenceStatus

pytestmark = pytest.mark.usefixtures("running_rows_way")


def make_scheduler(
    *,
    budget: int = 64,
    max_num_seqs: int = 8,
    block_size: int = 4,
    num_blocks: int = 64,
    max_model_len: int = 64,
    prefix_caching: bool = True,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
        CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
        num_blocks=num_blocks,
        max_model_len=max_model_len,
    )


def request(
    request_id: str, prompt: list[int] | range, max_tokens: int | None = 100, **params: object
) -> TokenizedRequest:
    return TokenizedRequest(
        request_id=request_id,
        prompt_token_ids=tuple(prompt),
        params=SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
        eos_token_ids=(0,),
        arrival_time=0.0,
    )


def sample(
    sched: Scheduler,
    batch: StepBatch,
    token: int = 7,
    finish: dict[int, tuple[FinishReason, int | None]] | None = None,
) -> list:
    """Feed back one token for every row that samples (`finish` sets finish reasons)."""
    finish = finish or {}
    tokens = tuple(
        SampledToken(
            seq_id=row.seq_id,
            token_id=token,
            finish_reason=finish.get(row.seq_id, (None, None))[0],
            stop_reason=finish.get(row.seq_id, (None, None))[1],
        )
        for row in batch.rows
        if row.sample
    )
    return sched.apply(StepTokens(step_id=batch.step_id, sampled=SampledTokens.of(tokens)))


def step(sched: Scheduler, token: int = 7) -> StepBatch:
    batch = sched.schedule()
    assert batch is not None
    sample(sched, batch, token)
    return batch


def rows(batch: StepBatch) -> dict[int, tuple[int, int, bool]]:
    """seq_id -> (num_computed_tokens, number of tokens this step, sample)."""
    return {r.seq_id: (r.num_computed_tokens, len(r.token_ids), r.sample) for r in batch.rows}


# ---------------------------------------------------------------------------- construction


def test_rejects_a_cache_smaller_than_one_sequence() -> None:
    with pytest.raises(ConfigError):
        make_scheduler(num_blocks=3, block_size=4, max_model_len=13)
    make_scheduler(num_blocks=4, block_size=4, max_model_len=16)


def test_add_request_validates_and_resolves_max_tokens() -> None:
    sched = make_scheduler(max_model_len=16)
    with pytest.raises(SchedulerError):
        sched.add_request(request("empty", []))
    with pytest.raises(SchedulerError):
        sched.add_request(request("long", range(17)))
    assert sched.add_request(request("a", range(10), max_tokens=None)) == [0]
    with pytest.raises(SchedulerError):
        sched.add_request(request("a", range(3)))
    seq = sched.get_sequence(0)
    assert seq is not None and seq.output_limit == 6  # up to the context
    sched.add_request(request("full", range(16), max_tokens=None))  # still samples one ...
    full = sched.get_sequence(1)
    assert full is not None and full.output_limit == 0  # ... which the length rule ends
    assert sched.add_request(request("b", range(3), n=3)) == [2, 3, 4]
    assert sched.has_unfinished()
    assert sched.stats.num_waiting == 5


def test_nothing_to_do_returns_none() -> None:
    sched = make_scheduler()
    assert sched.schedule() is None
    assert not sched.has_unfinished()


# ---------------------------------------------------------------------------- budget, chunks


def test_token_budget_and_max_num_seqs() -> None:
    sched = make_scheduler(budget=10, max_num_seqs=3)
    for i in range(5):
        sched.add_request(request(f"r{i}", range(1, 5)))
    b0 = sched.schedule()
    assert b0 is not None
    # Two whole prompts, then the third takes what budget remains.
    assert rows(b0) == {0: (0, 4, True), 1: (0, 4, True), 2: (0, 2, False)}
    assert [s.seq_id for s in b0.started] == [0, 1, 2]
    sample(sched, b0)
    b1 = sched.schedule()
    assert b1 is not None
    # Running first (decodes and the chunk's rest); max_num_seqs keeps r3, r4 waiting.
    assert rows(b1) == {0: (4, 1, True), 1: (4, 1, True), 2: (2, 2, True)}
    assert sched.stats.num_running == 3 and sched.stats.num_waiting == 2
    assert b1.started == ()


def test_chunked_prefill_exact_chunks_and_block_tables() -> None:
    sched = make_scheduler(budget=8, block_size=4)
    prompt = list(range(100, 121))  # 21 tokens
    sched.add_request(request("a", prompt))
    expected = [(0, 8, False, 2), (8, 8, False, 4), (16, 5, True, 6)]
    for start, n, samples, num_blocks in expected:
        batch = step(sched, token=55)
        (row,) = batch.rows
        assert (row.num_computed_tokens, len(row.token_ids), row.sample) == (start, n, samples)
        assert row.token_ids == tuple(prompt[start : start + n])
        assert row.block_table == tuple(range(num_blocks))
        assert row.num_output_tokens == 0
    batch = step(sched)
    (row,) = batch.rows
    assert (row.token_ids, row.num_computed_tokens, row.sample) == ((55,), 21, True)
    assert row.num_output_tokens == 1
    assert row.block_table == tuple(range(6))  # position 21 still fits block 5


def test_running_decodes_are_never_starved_by_a_long_prompt() -> None:
    sched = make_scheduler(budget=16, max_num_seqs=8, num_blocks=64, max_model_len=256)
    for i in range(3):
        sched.add_request(request(f"d{i}", [1, 2, 3, 4]))
    step(sched)
    sched.add_request(request("long", range(1000, 1100)))  # 100 tokens, no cache hit
    prefilled = 0
    while prefilled < 100:
        batch = step(sched)
        r = rows(batch)
        # Every running decode gets its token each step; the prompt gets the rest.
        assert all(r[i][1:] == (1, True) for i in range(3))
        assert r[3] == (prefilled, min(13, 100 - prefilled), prefilled + 13 >= 100)
        assert sum(len(x.token_ids) for x in batch.rows) <= 16
        prefilled += r[3][1]


def reorder_running(sched: Scheduler, seqs: list[Sequence]) -> None:
    """Put the running sequences in this order (as admissions after preemptions can)."""
    sched.running.remove(list(sched.running))
    for seq in seqs:
        blocks = sched.kv.seq_blocks(seq.seq_id)
        assert blocks is not None
        sched.running.append(seq, blocks)


def test_reserved_budget_protects_later_running_sequences_whatever_their_order() -> None:
    """The reservation rule does not depend on decodes being older than a long prefill."""
    sched = make_scheduler(budget=16, max_model_len=256, num_blocks=64)
    for i in range(3):
        sched.add_request(request(f"d{i}", [1, 2, 3, 4]))
    step(sched)
    sched.add_request(request("long", range(1000, 1100)))
    step(sched)
    reorder_running(sched, list(sched.running)[::-1])  # put the long prefill first
    batch = sched.schedule()
    assert batch is not None
    assert rows(batch) == {3: (13, 13, False), 2: (5, 1, True), 1: (5, 1, True), 0: (5, 1, True)}


def test_budget_smaller_than_max_num_seqs_caps_running() -> None:
    sched = make_scheduler(budget=3, max_num_seqs=8)
    for i in range(5):
        sched.add_request(request(f"r{i}", [5]))
    b0 = step(sched)
    assert len(b0.rows) == 3
    b1 = step(sched)
    assert sorted(rows(b1)) == [0, 1, 2]  # three running decodes fill the budget


def test_fcfs_head_blocks_later_requests() -> None:
    sched = make_scheduler(budget=64, block_size=4, num_blocks=8, max_model_len=32)
    sched.add_request(request("a", range(1, 21)))  # 5 blocks
    sched.add_request(request("b", range(100, 116)))  # 4 blocks: does not fit after a
    sched.add_request(request("c", [9]))  # 1 block would fit, but FCFS
    b0 = sched.schedule()
    assert b0 is not None
    assert list(rows(b0)) == [0]
    assert sched.stats.num_waiting == 2


# ---------------------------------------------------------------------------- preemption


def test_preemption_by_recompute_then_readmission_hits_its_own_blocks() -> None:
    sched = make_scheduler(budget=32, block_size=4, num_blocks=6, max_model_len=24)
    sched.add_request(request("a", range(1, 9), max_tokens=2))  # 8 tokens: blocks 0, 1
    sched.add_request(request("c", range(21, 33)))  # 12 tokens: blocks 2, 3, 4
    b0 = sched.schedule()
    assert b0 is not None
    assert {r.seq_id: r.block_table for r in b0.rows} == {0: (0, 1), 1: (2, 3, 4)}
    sample(sched, b0, token=90)
    assert sched.kv.pool.free_queue() == [5]

    # a's decode needs a 3rd block (5). c then needs a 4th: none left, and c is the
    # youngest running sequence, so it preempts itself; nothing is admitted this step.
    b1 = sched.schedule()
    assert b1 is not None
    assert rows(b1) == {0: (8, 1, True)}
    assert b1.rows[0].block_table == (0, 1, 5)
    seq_c = sched.get_sequence(1)
    assert seq_c is not None
    assert seq_c.status is SequenceStatus.PREEMPTED and seq_c.num_computed_tokens == 0
    assert sched.stats.num_preemptions == 1 and sched.stats.num_waiting == 1
    assert sched.kv.pool.free_queue() == [4, 3, 2]  # c's blocks, tail first, still cached
    # a reaches max_tokens = 2 and frees its blocks tail first.
    (finished,) = sample(sched, b1, token=91)
    assert (finished.seq_id, finished.finish_reason) == (0, "length")
    assert sched.kv.pool.free_queue() == [4, 3, 2, 5, 1, 0]

    # c comes back: its 13 tokens hit its own 3 cached blocks; it recomputes 1 token.
    b2 = sched.schedule()
    assert b2 is not None
    assert b2.released == (0,)
    assert b2.started == ()  # not started again downstream
    (row,) = b2.rows
    assert (row.seq_id, row.num_computed_tokens, row.token_ids, row.sample) == (1, 12, (90,), True)
    assert row.block_table == (2, 3, 4, 5)
    assert row.num_output_tokens == 1
    assert sched.stats.prefix_cache_hits == 12
    assert sched.stats.prefix_cache_queries == 8 + 12 + 13
    assert seq_c.num_cached_tokens == 0  # counted at first admission only


def test_preemption_takes_the_youngest_other_sequence_first() -> None:
    sched = make_scheduler(budget=32, block_size=4, num_blocks=4, max_model_len=16)
    for i, name in enumerate("abc"):
        sched.add_request(request(name, range(4 * i + 1, 4 * i + 5)))  # one full block each
    b0 = step(sched, token=8)
    assert [r.block_table for r in b0.rows] == [(0,), (1,), (2,)]
    b1 = sched.schedule()
    assert b1 is not None
    # a takes the last free block; b needs one too, so c (youngest) is preempted and its
    # freed block goes to b (c's hash is evicted with it).
    assert {r.seq_id: r.block_table for r in b1.rows} == {0: (0, 3), 1: (1, 2)}
    assert sched.stats.num_preemptions == 1
    sample(sched, b1, token=9)
    assert sched.kv.pool.num_free_blocks == 0
    # c waits until blocks come back, then recomputes all 5 tokens (its cache hit is gone).
    sched.abort_request("a")
    b2 = sched.schedule()
    assert b2 is not None
    assert b2.released == (0,)
    assert rows(b2) == {1: (5, 1, True), 2: (0, 5, True)}
    assert b2.rows[1].token_ids == (9, 10, 11, 12, 8)
    assert b2.rows[1].block_table == (3, 0)


def test_a_preempted_sequence_gives_its_reserved_token_to_those_before_it() -> None:
    """Every later running sequence keeps one token of the budget; once one is preempted
    in the step, its token goes to the sequences scheduled after the preemption."""
    sched = make_scheduler(budget=7, block_size=4, num_blocks=5, max_model_len=16)
    sched.add_request(request("a", [1, 2, 3]))
    sched.add_request(request("c", [4, 5, 6, 7]))
    step(sched)  # a: 3 tokens in block 0; c: 4 in block 1
    sched.add_request(request("b", range(100, 111)))  # 11 prompt tokens
    b1 = step(sched)  # a and c decode (c takes block 2), b its first 5 (blocks 3 and 4)
    assert rows(b1)[2] == (0, 5, False) and sched.kv.pool.num_free_blocks == 0
    a, c, b = sched.running
    reorder_running(sched, [a, b, c])  # c youngest
    b2 = sched.schedule()
    assert b2 is not None
    # a needs a block: c is preempted; b then has the 6 tokens left, its whole prompt's rest
    assert sched.stats.num_preemptions == 1
    assert rows(b2) == {0: (4, 1, True), 2: (5, 6, True)}


def test_preempted_sequence_keeps_its_place_at_the_front() -> None:
    sched = make_scheduler(budget=32, block_size=4, num_blocks=4, max_model_len=16)
    sched.add_request(request("a", [1, 2, 3, 4]))
    sched.add_request(request("b", [5, 6, 7, 8, 9, 10, 11, 12]))
    b0 = step(sched)
    assert list(rows(b0)) == [0, 1]
    sched.add_request(request("late", [3]))
    b1 = sched.schedule()  # a needs block 3; b needs a 3rd block: b preempts itself
    assert b1 is not None and list(rows(b1)) == [0]
    assert [s.request_id for s in sched.waiting] == ["b", "late"]


# ---------------------------------------------------------------------------- prefix cache


def test_siblings_share_prompt_blocks_in_the_same_step() -> None:
    sched = make_scheduler(budget=64, block_size=4)
    assert sched.add_request(request("a", range(1, 11), n=2)) == [0, 1]
    batch = sched.schedule()
    assert batch is not None
    first, second = batch.rows
    assert (first.num_computed_tokens, len(first.token_ids), first.block_table) == (
        0,
        10,
        (0, 1, 2),
    )
    # The sibling reuses the two full prompt blocks hashed for the first in this very step.
    assert (second.num_computed_tokens, second.token_ids, second.block_table) == (
        8,
        (9, 10),
        (0, 1, 3),
    )
    assert [sched.kv.pool.ref_cnt(b) for b in range(4)] == [2, 2, 1, 1]
    assert [s.index for s in batch.started] == [0, 1]
    assert sched.stats.prefix_cache_hits == 8


def test_siblings_without_prefix_caching_compute_separately() -> None:
    sched = make_scheduler(budget=64, block_size=4, prefix_caching=False)
    sched.add_request(request("a", range(1, 11), n=2))
    batch = sched.schedule()
    assert batch is not None
    assert [(r.num_computed_tokens, r.block_table) for r in batch.rows] == [
        (0, (0, 1, 2)),
        (0, (3, 4, 5)),
    ]
    assert sched.kv.pool.num_cached_blocks == 0
    assert sched.stats.prefix_cache_queries == 0


def test_prompt_logprobs_requests_compute_every_prompt_token() -> None:
    sched = make_scheduler(budget=64, block_size=4)
    sched.add_request(request("a", range(1, 11)))
    step(sched)
    sched.add_request(request("b", range(1, 11), prompt_logprobs=1))
    sched.add_request(request("c", range(1, 11)))
    batch = sched.schedule()
    assert batch is not None
    assert rows(batch) == {0: (10, 1, True), 1: (0, 10, True), 2: (8, 2, True)}


def test_later_request_hits_a_finished_requests_blocks() -> None:
    sched = make_scheduler(budget=64, block_size=4, num_blocks=16)
    sched.add_request(request("a", range(1, 13), max_tokens=1))
    b0 = step(sched)
    assert b0.rows[0].block_table == (0, 1, 2)
    sched.add_request(request("b", [*range(1, 9), 50, 51]))
    b1 = sched.schedule()
    assert b1 is not None
    assert b1.released == (0,)
    (row,) = b1.rows
    assert (row.num_computed_tokens, row.token_ids, row.block_table) == (8, (50, 51), (0, 1, 3))


# ---------------------------------------------------------------------------- abort, finish


def test_abort_frees_blocks_at_once_and_releases_the_sequence() -> None:
    sched = make_scheduler(budget=64, block_size=4, num_blocks=16)
    sched.add_request(request("a", range(1, 10)))
    sched.add_request(request("b", range(1, 6)))
    b0 = sched.schedule()
    assert b0 is not None
    assert sched.kv.pool.num_used_blocks == 3 + 1  # b reuses a's first block
    (gone,) = sched.abort_request("a")
    assert (gone.seq_id, gone.finish_reason) == (0, "abort")
    assert sched.kv.pool.num_used_blocks == 2  # block 0 (still b's) and b's own block
    assert sched.kv.pool.free_queue()[-2:] == [2, 1]
    # The step already in flight still carries a token for a: it is ignored.
    assert sample(sched, b0) == []
    b1 = sched.schedule()
    assert b1 is not None
    assert b1.released == (0,)
    assert list(rows(b1)) == [1]
    assert sched.abort_request("a") == []
    assert sched.abort_request("never-seen") == []


def test_abort_of_waiting_request_is_not_released_downstream() -> None:
    sched = make_scheduler(budget=4)
    sched.add_request(request("a", range(1, 5)))
    sched.add_request(request("b", range(1, 5), n=2))
    step(sched)
    assert len(sched.abort_request("b")) == 2
    assert sched.stats.num_waiting == 0
    batch = sched.schedule()
    assert batch is not None and batch.released == ()


def test_stop_string_finish_frees_and_releases() -> None:
    sched = make_scheduler()
    sched.add_request(request("a", range(1, 6), n=2))
    step(sched)
    done = sched.finish_sequence(1, "###")
    assert done is not None
    assert (done.finish_reason, done.stop_reason, done.index) == ("stop", "###", 1)
    assert sched.finish_sequence(1, "###") is None
    batch = sched.schedule()
    assert batch is not None
    assert batch.released == (1,) and list(rows(batch)) == [0]


def test_finish_reasons_from_sampled_tokens() -> None:
    sched = make_scheduler()
    sched.add_request(request("a", [1, 2], max_tokens=10))
    sched.add_request(request("b", [1, 3], max_tokens=10))
    sched.add_request(request("c", [1, 4], max_tokens=10))
    batch = sched.schedule()
    assert batch is not None
    finished = sample(sched, batch, token=0, finish={0: ("stop", None), 1: ("stop", 42)})
    assert [(f.seq_id, f.finish_reason, f.stop_reason) for f in finished] == [
        (0, "stop", None),
        (1, "stop", 42),
    ]
    assert [f.num_output_tokens for f in finished] == [1, 1]
    batch = sched.schedule()
    assert batch is not None
    assert batch.released == (0, 1) and list(rows(batch)) == [2]
    assert sched.stats.num_running == 1 and sched.kv.pool.num_used_blocks == 1


def test_length_guard_finishes_on_max_tokens_and_max_model_len() -> None:
    """Tokens that arrive without the finish reason the stop rule gives them still end
    their sequences at the rule's length limit, and detokenize is told (it saw no finish)."""
    sched = make_scheduler(max_model_len=8, num_blocks=8)
    sched.add_request(request("a", range(1, 4), max_tokens=2))
    sched.add_request(request("b", range(1, 7), max_tokens=100))
    step(sched)
    finished = sample(sched, sched.schedule())  # type: ignore[arg-type]
    # a: 2 outputs = max_tokens; b: 6 + 2 tokens = max_model_len.
    assert [(f.seq_id, f.finish_reason, f.num_output_tokens) for f in finished] == [
        (0, "length", 2),
        (1, "length", 2),
    ]
    batch = sched.schedule()
    assert batch is not None and tuple(batch.rows) == () and batch.released == (0, 1)
    events = sched.choice_events()
    assert events is not None and events.ended == (0, 1)
    assert sched.schedule() is None
    assert not sched.has_unfinished()
    assert sched.kv.pool.num_used_blocks == 0


def test_never_schedules_past_max_model_len() -> None:
    sched = make_scheduler(max_model_len=6, num_blocks=8)
    sched.add_request(request("a", range(1, 4), max_tokens=100))
    positions: list[int] = []
    finished = []
    while sched.has_unfinished():
        batch = sched.schedule()
        assert batch is not None
        for r in batch.rows:
            positions.extend(range(r.num_computed_tokens, r.num_computed_tokens + len(r.token_ids)))
        finished += sample(sched, batch)
    # The 6th token is sampled from position 4 and never computed: the sequence is full.
    assert positions == [0, 1, 2, 3, 4]
    assert [(f.finish_reason, f.num_output_tokens) for f in finished] == [("length", 3)]


def test_tokens_for_unknown_or_finished_sequences_are_ignored() -> None:
    sched = make_scheduler()
    sched.add_request(request("a", [1, 2]))
    batch = sched.schedule()
    assert batch is not None
    stray = StepTokens(
        step_id=batch.step_id, sampled=SampledTokens.of((SampledToken(seq_id=99, token_id=3),))
    )
    assert sched.apply(stray) == []
    seq = sched.get_sequence(0)
    assert seq is not None and seq.token_ids == [1, 2]
    # The step is over and no token came for seq 0: its last token is computed again so it
    # samples again, and a late token carrying the old step id is not appended.
    again = sched.schedule()
    assert again is not None and rows(again) == {0: (1, 1, True)}
    assert again.rows[0].token_ids == (2,)
    late = StepTokens(
        step_id=batch.step_id, sampled=SampledTokens.of((SampledToken(seq_id=0, token_id=3),))
    )
    assert sched.apply(late) == []
    assert seq.token_ids == [1, 2]
    sample(sched, again, token=4)
    assert seq.token_ids == [1, 2, 4]


# ---------------------------------------------------------------------------- stats


def test_kv_cache_usage_counts_cached_free_blocks_as_free() -> None:
    sched = make_scheduler(block_size=4, num_blocks=10, max_model_len=40)
    sched.add_request(request("a", range(1, 9), max_tokens=1))
    batch = sched.schedule()
    assert batch is not None
    assert sched.stats.kv_cache_usage == pytest.approx(0.2)
    sample(sched, batch)
    assert sched.stats.kv_cache_usage == 0.0
    assert sched.kv.pool.num_cached_blocks == 2


# ---------------------------------------------------------------------------- steps in flight


def test_sequence_with_a_token_in_flight_is_not_scheduled_again() -> None:
    """With two steps in flight, a sequence whose next token is not known yet waits, while
    a prompt's non-sampling chunks keep going."""
    sched = make_scheduler(budget=8, block_size=4)
    sched.add_request(request("a", [1, 2]))
    b0 = sched.schedule()
    assert b0 is not None and rows(b0) == {0: (0, 2, True)}
    assert sched.schedule() is None  # a's token is still in flight
    sched.add_request(request("b", range(100, 120)))  # 20 tokens: 8 + 8 + 4
    b1 = sched.schedule()
    assert b1 is not None and rows(b1) == {1: (0, 8, False)}
    b2 = sched.schedule()
    assert b2 is not None and rows(b2) == {1: (8, 8, False)}
    sample(sched, b0, token=50)  # a's token arrives; the later steps sampled nothing
    sample(sched, b1)
    b3 = sched.schedule()
    assert b3 is not None
    assert rows(b3) == {0: (2, 1, True), 1: (16, 4, True)}
    assert b3.rows[0].token_ids == (50,)


def test_stop_string_and_abort_reach_preempted_sequences() -> None:
    sched = make_scheduler(budget=32, block_size=4, num_blocks=4, max_model_len=16)
    sched.add_request(request("a", [1, 2, 3, 4]))
    sched.add_request(request("b", range(5, 13)))
    step(sched)
    step(sched)  # b preempts itself: a needs block 3
    seq_b = sched.get_sequence(1)
    assert seq_b is not None and seq_b.status is SequenceStatus.PREEMPTED
    done = sched.finish_sequence(1, "!")
    assert done is not None and done.finish_reason == "stop" and done.num_output_tokens == 1
    assert sched.stats.num_waiting == 0
    batch = sched.schedule()
    assert batch is not None and batch.released == (1,)
    sample(sched, batch)
    (gone,) = sched.abort_request("a")
    assert gone.num_output_tokens == 3
    assert sched.kv.pool.num_used_blocks == 0


def test_reset_prefix_cache_only_when_idle() -> None:
    sched = make_scheduler(block_size=4)
    sched.add_request(request("a", range(1, 10), max_tokens=1))
    batch = sched.schedule()
    assert batch is not None
    assert not sched.reset_prefix_cache()  # blocks in use
    sample(sched, batch)
    assert sched.reset_prefix_cache()
    sched.add_request(request("b", range(1, 10)))
    again = sched.schedule()
    assert again is not None and rows(again) == {1: (0, 9, True)}


def test_cache_salt_isolates_prefix_hits_between_requests() -> None:
    sched = make_scheduler(budget=64, block_size=4, num_blocks=32, max_model_len=64)
    prompt = range(1, 14)  # 3 full blocks + 1 token

    def admit(request_id: str, salt: str | None) -> int:
        tokenized = msgspec.structs.replace(request(request_id, prompt, 1), cache_salt=salt)
        sched.add_request(tokenized)
        hits_before = sched.stats.prefix_cache_hits
        batch = sched.schedule()
        assert batch is not None
        sample(sched, batch)  # max_tokens 1: finishes, its blocks stay cached
        return sched.stats.prefix_cache_hits - hits_before

    assert admit("a1", "tenant-a") == 0
    assert admit("b1", "tenant-b") == 0  # another salt: no hit
    assert admit("n1", None) == 0  # no salt: no hit on salted blocks
    assert admit("a2", "tenant-a") == 12  # same salt: 3 blocks
    assert admit("n2", None) == 12  # the unsalted copy from n1


def test_a_resumed_ledger_requeues_what_never_ran_and_names_what_was_lost() -> None:
    """After a failed step loop, a fresh scheduler goes on from the old one's ledger alone:
    requests none of whose sequences started run as they are (salt included); started ones
    are lost; ids keep counting up and every started sequence is released downstream in
    the fresh scheduler's first batch, and ended for detokenize (no finishing token will
    come for them)."""
    old = make_scheduler(max_num_seqs=2)
    old.add_request(request("ran", range(1, 5), n=2))
    step(old)  # both "ran" sequences start
    old.add_request(request("waits", range(10, 14)))
    salted = msgspec.structs.replace(request("salted", range(20, 24), n=3), cache_salt="tenant")
    old.add_request(salted)
    ledger = old.ledger
    next_seq_id, next_step_id = ledger.next_seq_id, ledger.next_step_id
    fresh = make_scheduler(max_num_seqs=8)
    assert fresh.resume(ledger) == ["ran"]
    assert fresh.num_sequences == 4  # "waits" and the three "salted"
    assert [s.request_id for s in fresh.waiting] == ["waits", *["salted"] * 3]
    assert [s.cache_salt for s in fresh.waiting] == [None, *["tenant"] * 3]
    batch = fresh.schedule()
    assert batch is not None
    assert set(batch.released) == {0, 1}
    events = fresh.choice_events()
    assert events is not None and set(events.ended) == {0, 1}
    assert {c.seq_id for c in events.started} == {s.seq_id for s in batch.started}
    new_ids = {s.seq_id for s in batch.rows}
    assert min(new_ids) >= next_seq_id  # no id is used twice
    assert batch.step_id >= next_step_id


def test_the_ledger_forgets_what_finished() -> None:
    """A request whose sequences all finished is owed nothing: a resume neither runs it
    again nor reports it lost; one of n sequences finished leaves the request lost."""
    sched = make_scheduler(max_num_seqs=4)
    sched.add_request(request("done", range(1, 5)))
    sched.add_request(request("half", range(6, 9), n=2))
    sched.add_request(request("aborted", range(10, 13)))
    step(sched)
    for seq in [s for s in sched.running if s.request_id == "done"]:
        sched.finish_sequence(seq.seq_id, "stop")
    sched.finish_sequence(next(s for s in sched.running if s.request_id == "half").seq_id, "x")
    sched.abort_request("aborted")
    assert make_scheduler().resume(sched.ledger) == ["half"]


def test_counters_go_on_after_a_resume() -> None:
    """The metrics advance by the difference between two snapshots of the counters: a
    fresh scheduler that started them again from zero made that difference negative."""
    old = make_scheduler(max_num_seqs=2)
    old.add_request(request("ran", range(1, 5)))
    step(old)
    before = old.stats
    assert before.prefix_cache_queries > 0
    fresh = make_scheduler(max_num_seqs=2)
    fresh.resume(old.ledger)
    after = fresh.stats
    assert after.prefix_cache_queries == before.prefix_cache_queries
    assert after.prefix_cache_hits == before.prefix_cache_hits
    assert after.num_preemptions == before.num_preemptions


def finish_one_then_queue_another(sched: Scheduler) -> int:
    """Run a request's first step, finish it by a stop string and queue another: the next
    batch carries the finished sequence's release. Returns its seq id."""
    sched.add_request(request("done", range(1, 5)))
    step(sched)
    (seq_id,) = [s.seq_id for s in sched.running]
    sched.finish_sequence(seq_id, "stop")
    sched.add_request(request("next", range(6, 9)))
    return seq_id


def test_a_resume_releases_what_a_lost_batch_carried() -> None:
    """A batch's released ids reach downstream stages only through the step loop; if the
    loop fails on that batch, the fresh scheduler's first batch releases them again."""
    old = make_scheduler(max_num_seqs=2)
    seq_id = finish_one_then_queue_another(old)
    lost = old.schedule()  # carries the release; its tokens never come back
    assert lost is not None and lost.released == (seq_id,)
    fresh = make_scheduler(max_num_seqs=2)
    fresh.resume(old.ledger)
    batch = fresh.schedule()
    assert batch is not None and seq_id in batch.released
    # Once a batch's tokens are back, what it released is no longer owed.
    delivered = make_scheduler(max_num_seqs=2)
    first = finish_one_then_queue_another(delivered)
    step(delivered)
    again = make_scheduler(max_num_seqs=2)
    again.resume(delivered.ledger)
    batch = again.schedule()
    assert batch is None or first not in batch.released


def test_choice_events_start_before_the_batch_and_end_only_unseen_finishes() -> None:
    sched = make_scheduler()
    sched.add_request(msgspec.structs.replace(request("a", [1, 2], n=2), prompt_text="hi"))
    sched.add_request(request("b", [3, 4]))
    batch = sched.schedule()
    assert batch is not None
    events = sched.choice_events()
    assert events is not None and events.step_id == batch.step_id and events.ended == ()
    # detokenize's copy holds the very SeqStart the step loop gets, plus the text fields
    assert [c.seq for c in events.started] == list(batch.started)
    assert all(c.seq is s for c, s in zip(events.started, batch.started, strict=True))
    assert [(c.seq.request_id, c.seq.index, c.prompt_text) for c in events.started] == [
        ("a", 0, "hi"),
        ("a", 1, "hi"),
        ("b", 0, None),
    ]
    assert all(c.scheduled_time > 0 for c in events.started)
    assert sched.choice_events() is None  # said once
    # A token's finish (and a stop string's Finish) detokenize saw itself; an abort not.
    sample(sched, batch, finish={0: ("stop", None)})
    sched.finish_sequence(1, "\n")
    sched.abort_request("b")
    batch = sched.schedule()
    assert batch is not None and batch.released == (0, 1, 2)
    events = sched.choice_events()
    assert events is not None and events.started == () and events.ended == (2,)


def test_prompt_logits_are_asked_until_the_prompt_was_computed_once() -> None:
    """execute returns prompt logits for the rows `prompt_logits_for` names: every prompt
    chunk of a sequence asking for prompt logprobs, up to its first sampling step (the
    simulation checks that a recompute after preemption does not ask again)."""
    sched = make_scheduler(budget=4)
    sched.add_request(request("a", range(1, 7), prompt_logprobs=1))
    sched.add_request(request("b", range(1, 3)))
    b0 = sched.schedule()
    assert b0 is not None and rows(b0) == {0: (0, 4, False)}
    assert b0.prompt_logits_for == (0,)
    b1 = sched.schedule()
    assert b1 is not None and rows(b1) == {0: (4, 2, True), 1: (0, 2, True)}
    assert b1.prompt_logits_for == (0,)
    sample(sched, b1)
    b2 = sched.schedule()
    assert b2 is not None and 0 in rows(b2) and b2.prompt_logits_for == ()


def test_without_chunked_prefill_a_prompt_waits_for_a_step_that_holds_it_whole() -> None:
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=False),
        CacheConfig(block_size=4, enable_prefix_caching=False),
        num_blocks=64,
        max_model_len=64,
    )
    sched.add_request(request("a", range(1, 41), max_tokens=1))
    sched.add_request(request("b", range(1, 31), max_tokens=1))  # 40 + 30 > 64
    sched.add_request(request("c", range(1, 11), max_tokens=1))  # FCFS: waits behind b
    first = sched.schedule()
    assert first is not None and rows(first) == {0: (0, 40, True)}
    finished = sample(sched, first, finish={0: ("stop", None)})
    assert [f.seq_id for f in finished] == [0]
    second = sched.schedule()
    assert second is not None and rows(second) == {1: (0, 30, True), 2: (0, 10, True)}


def test_without_chunked_prefill_a_step_must_hold_the_longest_prompt() -> None:
    with pytest.raises(ConfigError, match="max_num_batched_tokens=32 is below max_model_len=64"):
        Scheduler(
            SchedulerConfig(max_num_batched_tokens=32, enable_chunked_prefill=False),
            CacheConfig(block_size=4),
            num_blocks=64,
            max_model_len=64,
        )


def test_a_batch_is_guided_while_a_constrained_sequence_samples_in_it() -> None:
    from flowllm.messages import StructuredOutputs

    sched = make_scheduler(budget=8)
    regex = StructuredOutputs(regex="[a-z]+")
    sched.add_request(request("free", range(1, 5), max_tokens=6))
    sched.add_request(request("json", range(10, 21), max_tokens=2, structured_outputs=regex))
    sched.add_request(request("aborted", range(30, 34), max_tokens=6, structured_outputs=regex))
    first = step(sched)  # free's prefill samples; json's first chunk does not
    assert rows(first) == {0: (0, 4, True), 1: (0, 4, False)}
    assert not first.guided
    second = step(sched)  # json's last chunk samples
    assert rows(second)[1] == (4, 7, True) and second.guided
    third = sched.schedule()
    assert third is not None and rows(third)[2] == (0, 4, True) and third.guided
    sample(sched, third, finish={1: ("length", None)})
    assert sched.abort_request("aborted")
    for _ in range(3):  # the constrained sequences have left: no batch is guided again
        batch = step(sched)
        assert not batch.guided and set(rows(batch)) == {0}
