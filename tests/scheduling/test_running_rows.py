"""The running table: a running sequence's step counters live in its row, and only there."""

from __future__ import annotations

import pytest

from flowllm.messages import SamplingParams
from flowllm.scheduling.kv_cache_manager import SeqBlocks
from flowllm.scheduling.running import RunningRows
from flowllm.scheduling.sequence import Sequence


def make_seq(seq_id: int, prompt: tuple[int, ...] = (5, 6, 7), **params: object) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        index=0,
        prompt_token_ids=prompt,
        params=SamplingParams(**params),  # type: ignore[arg-type]
        eos_token_ids=(0,),
        arrival_time=0.0,
        output_limit=10,
    )


def blocks(fast_limit: int) -> SeqBlocks:
    rec = SeqBlocks()
    rec.fast_limit = fast_limit
    return rec


def test_a_running_sequence_reads_and_writes_its_counters_in_its_row() -> None:
    rows = RunningRows(4)
    a, b = make_seq(10), make_seq(11, prompt=(1, 2), prompt_logprobs=1)
    a.num_computed_tokens, a.num_pending = 2, 1
    rows.append(a, blocks(7))
    rows.append(b, blocks(3))
    c = rows.cols
    assert (a.running_row, b.running_row) == (0, 1)
    assert c.seq_id[:2].tolist() == [10, 11]
    assert c.num_computed_tokens[:2].tolist() == [2, 0]
    assert c.num_pending[:2].tolist() == [1, 0]
    assert c.wants_prompt_logits[:2].tolist() == [False, True]
    assert c.num_tokens[:2].tolist() == [3, 2] and c.last_token[:2].tolist() == [7, 2]
    assert c.end[:2].tolist() == [13, 12] and c.fast_limit[:2].tolist() == [7, 3]
    c.num_computed_tokens[0] = 3  # written as a column ...
    assert a.num_computed_tokens == 3  # ... read through the attribute
    b.num_pending = 2  # written through the attribute ...
    assert c.num_pending[1] == 2  # ... is the row's
    b.wants_prompt_logits = False
    assert not c.wants_prompt_logits[1] and b.wants_prompt_logits is False
    assert type(a.num_computed_tokens) is int and type(b.wants_prompt_logits) is bool
    assert rows.cells["num_pending"][1] == 2  # a column and its cells are one memory


def test_leaving_hands_the_counters_back_and_moves_later_rows_up() -> None:
    rows = RunningRows(4)
    seqs = [make_seq(i) for i in range(3)]
    for i, seq in enumerate(seqs):
        rows.append(seq, blocks(10 + i))
        seq.num_computed_tokens = 3 + i
    first, middle, last = seqs
    generation = rows.generation
    rows.remove([middle])
    assert middle.running_in is None and middle.num_computed_tokens == 4
    middle.num_computed_tokens = 0  # its own again: the table does not see it
    assert list(rows) == [first, last] and last.running_row == 1
    assert rows.cols.seq_id[:2].tolist() == [0, 2]
    assert rows.cols.fast_limit[:2].tolist() == [10, 12]
    assert (first.num_computed_tokens, last.num_computed_tokens) == (3, 5)
    assert rows.generation == generation + 1
    assert rows.pop() is last and last.running_in is None and last.num_computed_tokens == 5
    assert rows.generation == generation + 2 and list(rows) == [first]
    with pytest.raises(RuntimeError, match="not in the running table"):
        last.leave_rows()


def test_no_more_rows_than_its_capacity() -> None:
    rows = RunningRows(1)
    rows.append(make_seq(0), blocks(4))
    with pytest.raises(RuntimeError, match="more than 1 running sequences"):
        rows.append(make_seq(1), blocks(4))
