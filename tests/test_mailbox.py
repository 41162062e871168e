"""The mailbox never blocks its sender and merges what a slow reader has not read."""

import anyio
import pytest

from flowllm.mailbox import MERGE_BATCH, Mailbox, Mailboxes, RequestFailed
from flowllm.messages import Chunk, RequestError, TokenLogprobs, merge_by_choice, merge_chunks


def chunk(index: int, text: str, ids: tuple[int, ...], finish: str | None = None) -> Chunk:
    return Chunk(
        request_id="r",
        index=index,
        text=text,
        token_ids=ids,
        logprobs=tuple(TokenLogprobs(i, -1.0, 1) for i in ids),
        finish_reason=finish,  # type: ignore[arg-type]
        num_output_tokens=len(ids),
    )


async def read_all(mailbox: Mailbox) -> list[Chunk]:
    return [c async for c in mailbox]


@pytest.mark.anyio
async def test_slow_reader_gets_merged_chunks_in_order() -> None:
    box = Mailbox("r", num_choices=2)
    box.put(chunk(0, "Hel", (1,)))
    box.put(chunk(1, "A", (7,)))
    box.put(chunk(0, "lo", (2,)))
    box.put(chunk(0, "!", (3,), finish="stop"))
    box.put(chunk(1, "B", (8,), finish="length"))
    got = await read_all(box)
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in got] == [
        (0, "Hello!", (1, 2, 3), "stop"),
        (1, "AB", (7, 8), "length"),
    ]
    assert [lp.token_id for lp in got[0].logprobs] == [1, 2, 3]
    assert box.done


@pytest.mark.anyio
async def test_reader_waits_for_chunks_and_ends_when_all_choices_finish() -> None:
    box = Mailbox("r", num_choices=1)
    seen: list[str] = []

    async def reader() -> None:
        async for c in box:
            seen.append(c.text)

    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        for piece in ("a", "b"):
            await anyio.sleep(0.01)
            box.put(chunk(0, piece, (0,)))
        await anyio.sleep(0.01)
        box.put(chunk(0, "c", (0,), finish="stop"))
    assert seen == ["a", "b", "c"]


@pytest.mark.anyio
async def test_error_is_raised_after_pending_text_and_later_puts_are_ignored() -> None:
    box = Mailbox("r", num_choices=1)
    box.put(chunk(0, "partial", (1,)))
    box.fail(RequestError(request_id="r", message="boom", kind="internal"))
    box.put(chunk(0, "ignored", (2,)))
    it = box.__aiter__()
    assert (await it.__anext__()).text == "partial"
    with pytest.raises(RequestFailed) as failed:
        await it.__anext__()
    assert failed.value.error.kind == "internal"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_merge_chunks_joins_a_choices_output_and_keeps_the_last_finish() -> None:
    parts = [chunk(0, t, (i,)) for i, t in enumerate(("a", "bc", "", "d"))]
    parts.append(chunk(0, "e", (9,), finish="length"))
    merged = merge_chunks(parts)
    assert (merged.text, merged.token_ids) == ("abcde", (0, 1, 2, 3, 9))
    assert [lp.token_id for lp in merged.logprobs] == [0, 1, 2, 3, 9]
    assert (merged.finish_reason, merged.num_output_tokens) == ("length", 1)
    assert merge_chunks(parts[:1]) is parts[0]


def test_merge_by_choice_keeps_choices_apart() -> None:
    arrived = [chunk(1, "x", (1,)), chunk(0, "a", (2,)), chunk(1, "y", (3,), finish="stop")]
    merged = merge_by_choice(arrived)
    assert {i: (c.text, c.token_ids) for i, c in merged.items()} == {
        1: ("xy", (1, 3)),
        0: ("a", (2,)),
    }
    assert merged[1].finish_reason == "stop" and merged[0].finish_reason is None


@pytest.mark.anyio
async def test_a_long_unread_output_merges_in_batches_to_the_same_chunk() -> None:
    box = Mailbox("r", num_choices=1)
    n = 3 * MERGE_BATCH + 5
    for i in range(n):
        box.put(chunk(0, f"<{i}>", (i,), finish="stop" if i == n - 1 else None))
    (got,) = await read_all(box)
    assert got.text == "".join(f"<{i}>" for i in range(n))
    assert got.token_ids == tuple(range(n))
    assert [lp.token_id for lp in got.logprobs] == list(range(n))
    assert got.finish_reason == "stop" and got.num_output_tokens == 1


def test_a_mailbox_is_not_proportional_to_n() -> None:
    """A huge n costs a count, not a set of choice indices (validation refuses it later)."""
    import time

    start = time.perf_counter()
    box = Mailbox("r", num_choices=10**12)
    assert time.perf_counter() - start < 0.01
    assert not box.done
    box.put(chunk(5, "x", (1,), finish="stop"))
    box.put(chunk(5, "x", (1,), finish="stop"))  # a repeated finish counts once
    assert box._num_choices - len(box._finished) == 10**12 - 1  # unfinished choices


def test_pending_counts_choices_until_the_first_chunk() -> None:
    boxes = Mailboxes()
    boxes.open("a", 4, 0.0)
    boxes.open("b", 2, 0.0)
    assert (boxes.num_pending, boxes.num_pending_choices) == (2, 6)
    boxes.deliver(Chunk(request_id="a", index=0, text="x", token_ids=(1,)))
    assert (boxes.num_pending, boxes.num_pending_choices) == (1, 2)
    boxes.close("b")
    assert (boxes.num_pending, boxes.num_pending_choices) == (0, 0)
    boxes.close("b")  # twice: still 0
    assert boxes.num_pending_choices == 0
