"""Turn one step's scheduled sequences into the model's flattened inputs and run it.

Every sequence contributes the tokens it computes this step (a prefill chunk or one
decode token); token k of a sequence sits at position `num_computed_tokens + k`, and its
K/V go to slot `block_table[pos // block_size] * block_size + pos % block_size`.
Logits come back for the last row of each sequence that samples, and for every row of the
sequences whose prompt logprobs were asked. A sequence verifying drafts runs as one row
per token, each a decode over the keys up to its position (every row's K/V is stored
before a layer attends), so its step has a decode step's shape and replays as one
(`step_plans`), and each of its rows samples. A placeholder row (a token sampled by a step
still in flight when the batch was built) reads its id from that step's sampled ids, which
stay on the device.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol

import msgspec
import numpy as np
import torch

from flowllm.kernels import native
from flowllm.kernels.workspace import Workspace
from flowllm.messages import ScheduledRows, ScheduledSeq
from flowllm.models import glibc_heap, step_plans
from flowllm.models.block_tables import BlockTables
from flowllm.models.context import AttentionContext
from flowllm.models.decode_buckets import DecodeBuckets
from flowllm.models.errors import ModelError

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]


class StepModel(Protocol):
    """What the runner needs of a model (GPT2Model and LlamaModel both are): a step is
    `compute_logits(forward_layers(embed(...), ...), ctx)`, split so that the layers of a
    decode step can be replayed (`flowllm.models.step_plans`).

    `compute_logits` returns a fresh [len(ctx.logits_indices), vocab] tensor: the runner
    hands its rows on without copying, and callers may edit them.
    """

    vocab_size: int

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def forward_layers(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, ...]: ...

    def compute_logits(
        self, hidden: tuple[torch.Tensor, ...], ctx: AttentionContext
    ) -> torch.Tensor: ...


class PoolingModel(Protocol):
    """What the runner needs of a model served for pooling (PagedCausalLM and BertModel
    both are): every row's last hidden states, the final norm applied."""

    hidden_size: int
    dtype: torch.dtype

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        ctx: AttentionContext,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


Rows = ScheduledRows | Sequence[ScheduledSeq]  # a step's rows: as columns, or one by one


def as_rows(rows: Rows) -> ScheduledRows:
    """A step's rows as columns (the step loop sends them so; callers that build a few
    rows one by one, such as the draft proposer and tests, may pass a sequence)."""
    return rows if isinstance(rows, ScheduledRows) else ScheduledRows.of(rows)


class StepInputError(ModelError):
    """A scheduled sequence is inconsistent (no tokens, or a block table too short)."""


class StepInputs:
    """The flattened host-side inputs of one step (built on CPU, then moved at once)."""

    def __init__(
        self,
        rows: ScheduledRows,
        block_size: int,
        prompt_logits_for: Collection[int],
        tables: BlockTables | None = None,
    ) -> None:
        """`tables`: the runner's, kept from the previous step (None: a new one)."""
        n_seqs = len(rows.seq_ids)
        q_lens = np.fromiter(rows.query_lens, np.int64, n_seqs)
        computed = np.fromiter(rows.num_computed_tokens, np.int64, n_seqs)
        if n_seqs and int(q_lens.min()) < 1:
            bad = rows.seq_ids[int(q_lens.argmin())]
            raise StepInputError(f"sequence {bad} is scheduled with no tokens")
        seq_lens = computed + q_lens
        tables = BlockTables() if tables is None else tables
        self.block_tables, t_lens = tables.update(rows.block_tables)  # [n_seqs, width]
        short = t_lens * block_size < seq_lens
        if short.any():
            i = int(np.argmax(short))
            raise StepInputError(
                f"sequence {rows.seq_ids[i]} reaches {int(seq_lens[i])} tokens, which need "
                f"{-(-int(seq_lens[i]) // block_size)} blocks of {block_size}, but its block "
                f"table has {int(t_lens[i])}"
            )
        num_tokens = len(rows.token_ids)
        self.input_ids = np.fromiter(rows.token_ids, np.int64, num_tokens)
        # Per-token sequence index and position: [num_tokens]. A decode step (one token
        # per sequence) needs no expansion.
        decode = num_tokens == n_seqs  # every row has one token (none has fewer)
        if decode:
            qsl = np.arange(n_seqs + 1, dtype=np.int64)
            seq_of_token = qsl[:-1]
            self.positions = computed
        else:
            qsl = np.zeros(n_seqs + 1, dtype=np.int64)
            np.cumsum(q_lens, out=qsl[1:])
            seq_of_token = np.repeat(np.arange(n_seqs), q_lens)
            self.positions = computed[seq_of_token] + (np.arange(num_tokens) - qsl[seq_of_token])
        block_ids = self.block_tables[seq_of_token, self.positions // block_size]
        self.slot_mapping = block_ids.astype(np.int64) * block_size + self.positions % block_size
        self.query_start_loc = qsl.astype(np.int32)
        self.seq_lens = seq_lens.astype(np.int32)
        self.max_query_len = 1 if decode else int(q_lens.max()) if n_seqs else 0
        self.max_seq_len = int(seq_lens.max()) if n_seqs else 0

        # Logit rows: each prompt-logits sequence's rows (in order), then the sampling rows.
        logit_rows: list[int] = []
        self.prompt_rows: dict[int, tuple[int, int]] = {}  # seq_id -> range in `logit_rows`
        if prompt_logits_for:
            for i, seq_id in enumerate(rows.seq_ids):
                if seq_id in prompt_logits_for:
                    start = len(logit_rows)
                    logit_rows.extend(range(int(qsl[i]), int(qsl[i + 1])))
                    self.prompt_rows[seq_id] = (start, len(logit_rows))
        samples = rows.sample
        last_rows = qsl[1:] - 1  # each sequence's last row
        sample_rows = last_rows if all(samples) else last_rows[np.array(samples, dtype=bool)]
        self.sample_at = range(len(logit_rows), len(logit_rows) + len(sample_rows))
        self.logits_indices = (
            np.concatenate([np.asarray(logit_rows, dtype=np.int64), sample_rows])
            if logit_rows
            else sample_rows
        )


def one_row_per_token(rows: ScheduledRows) -> ScheduledRows:
    """The step with each sequence that verifies drafts split into one sampling row per
    token (its last token, then each draft), each at its own position."""
    split: list[ScheduledSeq] = []
    for s in rows:
        if not s.num_draft_tokens:
            split.append(s)
            continue
        start = s.num_computed_tokens
        split.extend(
            msgspec.structs.replace(
                s, token_ids=(t,), num_computed_tokens=start + j, num_draft_tokens=0
            )
            for j, t in enumerate(s.token_ids)
        )
    return ScheduledRows.of(split)


class ModelRunner:
    """Runs a model over one step's sequences against its paged KV cache."""

    def __init__(
        self,
        model: StepModel,
        kv_caches: KVCaches,
        block_size: int,
        device: torch.device | str,
        enforce_eager: bool = False,
        decode_buckets: DecodeBuckets | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device)
        self._on_host = self.device.type == "cpu"  # the step's arrays are its tensors
        self.workspace = Workspace()  # the attention's scratch buffers, kept across steps
        self.block_tables = BlockTables()  # the latest step's, rewritten where they changed
        # decode steps' layers, replayed from recorded kernel calls (CPU) or from the CUDA
        # graphs of `decode_buckets`' sizes
        lib = native.library() if self.device.type == "cpu" else None
        self.plans = (
            None
            if enforce_eager
            else step_plans.for_device(model, kv_caches, self.device, lib, decode_buckets)
        )
        if self.device.type == "cpu":
            glibc_heap.keep_freed_memory_mapped()
        # whether a step gives the same results on any OpenMP thread count: on a GPU, and
        # on CPU with the native kernels, which split no sum between threads (torch's own
        # CPU products can), so a short step may run on the loop's one thread
        self.exact_on_any_threads = self.device.type != "cpu" or lib is not None

    def _tensor(self, a: np.ndarray[Any, Any]) -> torch.Tensor:
        t = torch.from_numpy(a)
        return t if self._on_host else t.to(self.device, non_blocking=True)

    def build_context(
        self,
        rows: Rows,
        prompt_logits_for: Collection[int] = frozenset(),
        sampled: Mapping[int, torch.Tensor] | None = None,
    ) -> tuple[StepInputs, torch.Tensor, torch.Tensor, AttentionContext]:
        """The host inputs, token ids, positions and attention context of one step;
        `sampled`: step id -> its sampled ids, which the placeholder rows read."""
        rows = as_rows(rows)
        if rows.num_draft_tokens:
            rows = one_row_per_token(rows)
        inp = StepInputs(rows, self.block_size, prompt_logits_for, self.block_tables)
        ctx = AttentionContext(
            slot_mapping=self._tensor(inp.slot_mapping),
            block_tables=self._tensor(inp.block_tables),
            query_start_loc=self._tensor(inp.query_start_loc),
            seq_lens=self._tensor(inp.seq_lens),
            logits_indices=self._tensor(inp.logits_indices),
            max_query_len=inp.max_query_len,
            max_seq_len=inp.max_seq_len,
            workspace=self.workspace,
        )
        input_ids = self._tensor(inp.input_ids)
        if sampled:
            self._fill_placeholders(rows, inp, input_ids, sampled)
        return inp, input_ids, self._tensor(inp.positions), ctx

    def _fill_placeholders(
        self,
        rows: ScheduledRows,
        inp: StepInputs,
        input_ids: torch.Tensor,
        sampled: Mapping[int, torch.Tensor],
    ) -> None:
        """Write each placeholder row's token, read from its step's sampled ids on the
        device (one gather and scatter per step read)."""
        starts = inp.query_start_loc
        by_step: dict[int, tuple[list[int], list[int]]] = {}
        for row, (step_id, sampling_row) in rows.input_from.items():
            at, sources = by_step.setdefault(step_id, ([], []))
            at.append(int(starts[row]))
            sources.append(sampling_row)
        for step_id, (at, sources) in by_step.items():
            ids = sampled.get(step_id)
            if ids is None:
                raise StepInputError(f"placeholder rows read step {step_id}'s sampled ids, "
                                     "which did not come")  # fmt: skip
            input_ids[self._tensor(np.asarray(at))] = ids[self._tensor(np.asarray(sources))]

    def run(
        self,
        rows: Rows,
        prompt_logits_for: Collection[int] = frozenset(),
        sampled: Mapping[int, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """One model step: (logits [num sampling seqs, vocab] float32 in batch order,
        {seq_id: float32 logits of every token computed this step} for `prompt_logits_for`).
        Row k of a prompt-logits tensor predicts the token after that step's k-th token.

        The tensors are row ranges of the model's output (copied only to convert to
        float32): no row belongs to two of them, and they are ordinary tensors (the model
        runs under no_grad, not inference mode), so callers may edit them in place. A copy
        of [256, 50257] float32 logits is 51 MB per step, which the sampler needs only when
        a logits processor edits them (it then uses a buffer of its own). `sampled`: the
        sampled ids that placeholder rows read, by step id (`build_context`)."""
        if not len(rows):
            empty = torch.empty(0, self.model.vocab_size, dtype=torch.float32, device=self.device)
            return empty, {}
        inp, input_ids, positions, ctx = self.build_context(rows, prompt_logits_for, sampled)
        with torch.no_grad():
            h = self.model.embed(input_ids, positions)
            if self.plans is not None:
                hidden = self.plans.forward_layers(h, positions, ctx)
            else:
                hidden = self.model.forward_layers(h, positions, self.kv_caches, ctx)
            out = self.model.compute_logits(hidden, ctx)  # [rows, vocab]
        at = inp.sample_at  # contiguous: the sampling rows come last
        logits = out[at[0] : at[-1] + 1] if at else out[:0]
        prompt = {sid: out[a:b].float() for sid, (a, b) in inp.prompt_rows.items()}
        return logits.float(), prompt

    def hidden_states(
        self, rows: Rows, token_type_starts: Mapping[int, int] | None = None
    ) -> torch.Tensor:
        """One step of a pooling model: the last hidden states [num_tokens, d] of every row,
        in batch order (`PoolingModel.hidden_states`). `token_type_starts`: seq id -> the
        position where a cross-encoder pair's second text (token type 1) starts."""
        model: PoolingModel = self.model  # type: ignore[assignment]
        if not len(rows):
            return torch.empty(0, model.hidden_size, dtype=model.dtype, device=self.device)
        rows = as_rows(rows)
        inp, input_ids, positions, ctx = self.build_context(rows)
        token_types = None
        if token_type_starts:
            never = np.iinfo(np.int64).max
            starts = np.fromiter(
                (token_type_starts.get(seq_id, never) for seq_id in rows.seq_ids),
                np.int64,
                len(rows.seq_ids),
            )
            row_start = np.repeat(starts, np.diff(inp.query_start_loc))  # [num_tokens]
            token_types = self._tensor((inp.positions >= row_start).astype(np.int64))
        with torch.no_grad():
            return model.hidden_states(input_ids, positions, self.kv_caches, ctx, token_types)
