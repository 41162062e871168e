"""A step's rows and sampled tokens as columns (`ScheduledRows`, `SampledTokens`): the
columns hold exactly what the per-row structs held, and inconsistent columns are refused,
built here or decoded from the wire."""

from __future__ import annotations

import msgspec
import pytest

from flowllm.messages import (
    PLACEHOLDER_TOKEN,
    SampledToken,
    SampledTokens,
    ScheduledRows,
    ScheduledSeq,
    StepBatch,
    StepTokens,
    TokenLogprobs,
)

SEQS = (
    ScheduledSeq(  # a prefill chunk that does not sample
        seq_id=3,
        token_ids=(5, 6, 7),
        num_computed_tokens=0,
        block_table=(0,),
        sample=False,
        num_output_tokens=0,
    ),
    ScheduledSeq(  # a decode
        seq_id=4,
        token_ids=(9,),
        num_computed_tokens=17,
        block_table=(1, 2),
        sample=True,
        num_output_tokens=2,
    ),
    ScheduledSeq(  # a placeholder row
        seq_id=8,
        token_ids=(PLACEHOLDER_TOKEN,),
        num_computed_tokens=20,
        block_table=(4, 5),
        sample=True,
        num_output_tokens=6,
        input_from=(11, 1),
    ),
    ScheduledSeq(  # its last token and two drafts
        seq_id=9,
        token_ids=(12, 13, 14),
        num_computed_tokens=30,
        block_table=(6, 7),
        sample=True,
        num_output_tokens=9,
        num_draft_tokens=2,
    ),
)

LP = TokenLogprobs(token_id=13, logprob=-0.5, rank=1, top=((13, -0.5),))
TOKENS = (
    SampledToken(seq_id=4, token_id=10),
    SampledToken(seq_id=9, token_id=13, logprobs=LP),
    SampledToken(seq_id=9, token_id=2, finish_reason="stop", stop_reason=2),
    SampledToken(seq_id=8, token_id=0, finish_reason="length"),
)


def test_scheduled_rows_hold_what_each_row_held() -> None:
    rows = ScheduledRows.of(SEQS)
    assert rows.query_lens == (3, 1, 1, 3)
    assert rows.token_ids == (5, 6, 7, 9, PLACEHOLDER_TOKEN, 12, 13, 14)
    assert rows.input_from == {2: (11, 1)}
    assert rows.num_draft_tokens == {3: 2}
    assert len(rows) == 4
    assert tuple(rows) == SEQS
    assert [rows[i] for i in range(-4, 4)] == [*SEQS, *SEQS]
    assert tuple(StepBatch(step_id=1, rows=rows).rows) == SEQS


def test_sampled_tokens_hold_what_each_token_held() -> None:
    sampled = SampledTokens.of(TOKENS)
    assert sampled.seq_ids == (4, 9, 9, 8)
    assert sampled.token_ids == (10, 13, 2, 0)
    assert sampled.finishes == {2: ("stop", 2), 3: ("length", None)}
    assert sampled.logprobs == (None, LP, None, None)
    assert tuple(sampled) == TOKENS
    assert sampled[-1] == TOKENS[-1]
    assert tuple(StepTokens(step_id=1, sampled=sampled).sampled) == TOKENS
    # a subset keeps each row's finish and logprobs, at the row's new index
    assert tuple(sampled.take([3, 1])) == (TOKENS[3], TOKENS[1])
    # without logprobs asked, the column stays empty
    assert SampledTokens.of(TOKENS[:1]).logprobs == ()


@pytest.mark.parametrize(
    "columns",
    [
        {"seq_ids": (1, 2), "token_ids": (5,)},
        {"seq_ids": (1,), "token_ids": (5,), "logprobs": (None, None)},
    ],
)
def test_sampled_tokens_refuse_columns_of_other_lengths(columns: dict[str, tuple]) -> None:
    with pytest.raises(ValueError, match="one token id"):
        SampledTokens(**columns)
    wire = msgspec.msgpack.encode(columns)
    with pytest.raises(msgspec.ValidationError, match="one token id"):
        msgspec.msgpack.decode(wire, type=SampledTokens)


@pytest.mark.parametrize(
    "change",
    [
        {"query_lens": (3, 1, 1)},  # a column short of a row
        {"token_ids": (5, 6, 7, 9, -1, 12, 13)},  # fewer token ids than query_lens sum to
        {"block_tables": ((0,), (1, 2), (4, 5), (6, 7), (8,))},  # a column over
    ],
)
def test_scheduled_rows_refuse_inconsistent_columns(change: dict[str, tuple]) -> None:
    good = msgspec.structs.asdict(ScheduledRows.of(SEQS))
    with pytest.raises(ValueError, match="one entry per row"):
        ScheduledRows(**{**good, **change})
    wire = msgspec.msgpack.encode({**good, **change})
    with pytest.raises(msgspec.ValidationError, match="one entry per row"):
        msgspec.msgpack.decode(wire, type=ScheduledRows)
