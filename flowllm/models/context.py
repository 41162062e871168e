"""The attention context of one model step, passed explicitly to every forward.

A step runs several sequences at once, their tokens flattened into one batch. The model
needs to know, for each token, where its K/V go in the paged cache, and, for each
sequence, which cache blocks hold its context and how long it is. Everything here is a
tensor on the model's device (plus two host-side maxima the kernels size their work by).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowllm.kernels.workspace import Workspace


@dataclass(frozen=True)
class AttentionContext:
    """Where one step's tokens live in the paged KV cache and which logits to return.

    Invariants: the tokens of sequence i are rows `query_start_loc[i]:query_start_loc[i+1]`
    of the flattened batch; `seq_lens[i]` counts sequence i's tokens in the cache after this
    step's K/V are stored (cached prefix + this step's tokens), so its query j of q_len is
    at position `seq_lens[i] - q_len + j`.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32, context length after this step
    logits_indices: torch.Tensor  # [num_logits] int64, rows of the batch to return logits for
    max_query_len: int  # max over sequences of this step's token count
    max_seq_len: int  # max of seq_lens
    workspace: Workspace | None = None  # the runner's scratch buffers, reused across steps

    @property
    def num_seqs(self) -> int:
        """How many sequences the step runs."""
        return int(self.seq_lens.shape[0])
