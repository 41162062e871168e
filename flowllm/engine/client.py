"""What callers of the graph (the HTTP API, the offline LLM) rely on, and nothing more."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from flowllm.config import RequestLimits
from flowllm.mailbox import Mailbox
from flowllm.messages import GenerateRequest
from flowllm.models.pooler_config import PoolerConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class EngineClient(Protocol):
    """A running graph seen from outside: submit requests, read their mailboxes, abort."""

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...

    @property
    def healthy(self) -> bool: ...  # /health: false while a part restarts or is stuck

    @property
    def accepting(self) -> bool: ...  # false once the engine failed for good or stopped

    @property
    def full(self) -> bool: ...  # admission is full: any request now would be refused (503)

    @property
    def limits(self) -> RequestLimits: ...

    @property
    def pooler(self) -> PoolerConfig | None: ...  # a model served for pooling: its pooler

    def submit(self, request: GenerateRequest) -> Mailbox:
        """Enter the graph; raises Overloaded when admission is full, RequestFailed (a
        400) when the request could never be admitted."""
        ...

    def submit_all(self, requests: Sequence[GenerateRequest]) -> list[Mailbox]:
        """`submit` for the prompts of one API request: all are admitted, or none."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop a request now; its KV blocks are freed. Unknown ids are ignored."""
        ...
