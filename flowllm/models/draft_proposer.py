"""Drafts from a draft model: each sequence's greedy continuation, k tokens ahead.

Per step, for the sequences that go on, the draft's KV cache first catches up with each
sequence's accepted tokens (the prompt on first sight, then the tokens accepted since),
in passes of at most `max_batch_tokens` tokens whose last row gives the first draft; then
k - 1 decode passes, all sequences in one batch, give the others. Every draft is the
argmax of the draft's logits: a point-mass proposal, which the target's verification
keeps exact for greedy and sampled requests alike (flowllm.sampling.sampler).

The drafts a sequence's K/V were written for stay in the cache: those the target accepted
count as caught up, the others are overwritten by the next catch-up (the cache rolls back
to the accepted length). Blocks come from a free list over the draft's cache; a sequence
that needs more than is free takes the blocks of the sequences idle longest (they
recompute when they draft again), and one that still does not fit drafts nothing that
step. A sequence drafts no further than the draft's context (`DraftModel.max_len`).

The proposer's state (block tables, what each sequence's cache holds) is rebuilt from
nothing by a new instance: a sequence it never saw catches up from its first token.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from flowllm.kernels.argmax import argmax_rows
from flowllm.messages import ScheduledSeq
from flowllm.models.draft import DraftModel
from flowllm.models.runner import ModelRunner

TokenIds = np.ndarray[tuple[int], np.dtype[np.int64]]


class _DraftSeq:
    """What the draft's cache holds of one sequence: K/V of its first `computed` tokens,
    then of `written`, the drafts that followed them last time."""

    __slots__ = ("blocks", "computed", "last_used", "written")

    def __init__(self) -> None:
        self.blocks: list[int] = []
        self.computed = 0
        self.written: tuple[int, ...] = ()
        self.last_used = 0


class DraftProposer:
    """Up to `k` greedy drafts per sequence from `draft`, on its own block tables."""

    def __init__(
        self,
        draft: DraftModel,
        k: int,
        max_batch_tokens: int,
        enforce_eager: bool = False,
    ) -> None:
        self.draft = draft
        self.k = k
        self.max_batch_tokens = max(1, max_batch_tokens)
        self.runner = ModelRunner(
            draft.model,
            draft.kv_caches,
            draft.block_size,
            draft.device,
            enforce_eager=enforce_eager,
        )
        self._free = list(range(draft.num_blocks - 1, -1, -1))  # a stack: low ids first
        self._seqs: dict[int, _DraftSeq] = {}
        self._step = 0

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def holds(self) -> set[int]:
        """The sequences whose K/V the draft's cache holds."""
        return set(self._seqs)

    def release(self, seq_ids: Iterable[int]) -> None:
        """Forget sequences (finished, aborted): their blocks go back to the free list."""
        for seq_id in seq_ids:
            seq = self._seqs.pop(seq_id, None)
            if seq is not None:
                self._free.extend(reversed(seq.blocks))

    def propose(self, going: Mapping[int, TokenIds]) -> dict[int, tuple[int, ...]]:
        """The drafts of each sequence of `going` (seq id -> its tokens: prompt and
        accepted outputs) that has room in the draft's cache and context."""
        self._step += 1
        block_size = self.draft.block_size
        todo: list[tuple[int, TokenIds, _DraftSeq, int]] = []
        for seq_id, tokens in going.items():
            n = len(tokens)
            k = min(self.k, self.draft.max_len - n + 1)  # its last draft's position fits
            if k < 1:
                self.release((seq_id,))
                continue
            seq = self._seqs.get(seq_id)
            if seq is None:
                seq = self._seqs[seq_id] = _DraftSeq()
            if seq.written:  # the drafts the target accepted keep their K/V
                ahead = tokens[seq.computed : seq.computed + len(seq.written)]
                same = ahead == np.asarray(seq.written[: len(ahead)], dtype=np.int64)
                seq.computed += len(ahead) if same.all() else int(np.argmin(same))
                seq.written = ()
            # the last token is always computed again: its logits give the first draft
            seq.computed = min(seq.computed, n - 1)
            if not self._reserve(seq_id, seq, -(-(n + k - 1) // block_size), going):
                self.release((seq_id,))
                continue
            seq.last_used = self._step
            todo.append((seq_id, tokens, seq, k))
        if not todo:
            return {}
        drafts = self._catch_up(todo)
        for j in range(1, self.k):
            rows = [(seq_id, tokens, seq) for seq_id, tokens, seq, k in todo if k > j]
            if not rows:
                break
            batch = [
                ScheduledSeq(
                    seq_id=seq_id,
                    token_ids=(drafts[seq_id][-1],),
                    num_computed_tokens=len(tokens) + j - 1,
                    block_table=tuple(seq.blocks),
                    sample=True,
                    num_output_tokens=0,
                )
                for seq_id, tokens, seq in rows
            ]
            for (seq_id, _, _), token in zip(rows, self._greedy(batch), strict=True):
                drafts[seq_id].append(token)
        result: dict[int, tuple[int, ...]] = {}
        for seq_id, tokens, seq, _ in todo:
            proposed = tuple(drafts[seq_id])
            seq.computed = len(tokens)
            seq.written = proposed[:-1]  # the last draft's K/V were never computed
            result[seq_id] = proposed
        return result

    def _catch_up(self, todo: list[tuple[int, TokenIds, _DraftSeq, int]]) -> dict[int, list[int]]:
        """Compute each sequence's tokens from `computed` to its last, in passes of at most
        `max_batch_tokens` tokens; each sequence's first draft, from its last row. What one
        step's acceptance leaves (at most k + 1 tokens) runs as one decode row per token,
        so that such a pass has a decode step's shape and replays as one
        (flowllm.models.step_plans); a longer run (a prompt) as prefill chunks."""
        drafts: dict[int, list[int]] = {}
        start = {seq_id: seq.computed for seq_id, _, seq, _ in todo}
        while len(drafts) < len(todo):
            budget = self.max_batch_tokens
            batch: list[ScheduledSeq] = []
            for seq_id, tokens, seq, _ in todo:
                at, n = start[seq_id], len(tokens)
                take = min(n - at, budget)
                if seq_id in drafts or take < 1:
                    continue
                ids = tokens[at : at + take].tolist()
                table = tuple(seq.blocks)
                if at + take == n and take <= self.k + 1:
                    rows = [(at + j, (t,)) for j, t in enumerate(ids)]
                else:
                    rows = [(at, tuple(ids))]
                batch.extend(
                    ScheduledSeq(
                        seq_id=seq_id,
                        token_ids=row,
                        num_computed_tokens=position,
                        block_table=table,
                        sample=position + len(row) == n,
                        num_output_tokens=0,
                    )
                    for position, row in rows
                )
                start[seq_id] = at + take
                budget -= take
            sampled = [s.seq_id for s in batch if s.sample]
            for seq_id, token in zip(sampled, self._greedy(batch), strict=True):
                drafts[seq_id] = [token]
        return drafts

    def _greedy(self, batch: list[ScheduledSeq]) -> list[int]:
        """One pass of the draft model: the argmax of each sampling row's logits."""
        logits, _ = self.runner.run(batch)
        return [int(t) for t in argmax_rows(logits).tolist()]

    def _reserve(
        self, seq_id: int, seq: _DraftSeq, blocks: int, protected: Mapping[int, Any]
    ) -> bool:
        """Give `seq` `blocks` blocks, taking those of the sequences idle longest (not in
        `protected`) when the free list runs short; False when they do not suffice."""
        missing = blocks - len(seq.blocks)
        if missing <= 0:
            return True
        if missing > len(self._free):
            idle = sorted(
                (s.last_used, other)
                for other, s in self._seqs.items()
                if other != seq_id and other not in protected
            )
            for _, other in idle:
                if missing <= len(self._free):
                    break
                self.release((other,))
        if missing > len(self._free):
            return False
        seq.blocks.extend(self._free.pop() for _ in range(missing))
        return True
