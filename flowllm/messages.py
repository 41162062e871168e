"""Every message that crosses a channel: the data flow of flowllm in one file.

Upstream of `schedule` messages are per request; from `schedule` on they are per step, so
one message carries every running sequence's data for that step and a channel hop costs
the same at batch 1 and batch 256.

    ingest ─GenerateRequest─▶ validate ─ValidRequest─▶ tokenize ─TokenizedRequest─▶ schedule
    schedule ─StepBatch─▶ execute ─StepLogits─▶ sample ─StepTokens─▶ schedule, detokenize
    schedule ─StepBatch─▶ guide ─StepMasks─▶ sample   (beside execute: constrained outputs)
    sample ─StepTokens─▶ propose ─StepTokens─▶ schedule  (speculative: drafts added)
    schedule ─StepBatch─▶ execute ─StepHidden─▶ pool ─StepTokens─▶ schedule
                              (the pooling graph: pool ─TextDeltas─▶ deliver, vectors as chunks)
    schedule ─ChoiceEvents─▶ detokenize       (a choice starts, or ends unseen by detokenize)
    detokenize ─TextDeltas─▶ deliver ─Chunk─▶ the request's mailbox (flowllm/mailbox.py)
    detokenize ─Finish─▶ schedule            (a stop string ended a sequence)
    any stage ─RequestError─▶ deliver       (the request leaves the graph there)
    ingest ─Abort─▶ ... ─▶ schedule          (client gone, API cancel)

A sequence is one generated choice: a request with `n = 2` has two sequences, which share
the prompt's KV blocks. Sequences are numbered by `schedule` (`seq_id`), which owns them;
each other stage that keeps per-sequence state holds a read-only copy of what it uses,
delivered by schedule on a route that passes only through stages that use it (docs/stages.md,
"Who owns a sequence's state"): the step loop's stages (guide, sample) from
`StepBatch.started` the first step a sequence runs, dropped when it appears in
`StepBatch.released`; detokenize from `ChoiceEvents`, sent on its own channel before the
batch, so it always arrives before the sequence's first token.

The structs made once per sequence per step (`ScheduledSeq`, `SampledToken`,
`TokenLogprobs`, `Chunk`) hold only numbers, strings and tuples of such, so they can never
be part of a reference cycle: they are declared `gc=False`, which keeps the cyclic garbage
collector from tracking them, and from running as often as hundreds of new objects a step
would make it (benchmarks/README.md, "Pipeline overhead").
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from typing import Any, Literal

import msgspec

FinishReason = Literal["stop", "length", "abort"]


class ReasoningTokens(msgspec.Struct, frozen=True, kw_only=True):
    """How a reasoning model's output marks its thinking part, in token ids
    (flowllm.text.reasoning): a constraint that carries it applies to the answer only."""

    start: int  # `<think>`
    end: int  # `</think>`
    # The output starts inside the thinking part (deepseek_r1); else it thinks only when
    # its first token is `start` (qwen3).
    opens_inside: bool


class StructuredOutputs(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A constraint on the output, as vLLM's `structured_outputs`: exactly one kind set.

    `json` is a JSON schema (an object, or its JSON text); `grammar` is EBNF/GBNF.
    `param` is where the client gave it (`response_format`, `guided_json`...), so that a
    refusal names the field the client sent; it is not part of the constraint.
    `after_reasoning`: a chat request of a server with a reasoning parser; the constraint
    starts after the thinking part, which is left free.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    param: str = "structured_outputs"
    after_reasoning: ReasoningTokens | None = None


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How to sample one request, as in vLLM's SamplingParams (validated by `validate`)."""

    n: int = 1
    max_tokens: int | None = 16  # None: up to the remaining context
    min_tokens: int = 0
    temperature: float = 1.0  # < 1e-5 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs of each generated token
    prompt_logprobs: int | None = None  # top-N logprobs of each prompt token
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None  # filled in by the guide stage

    @property
    def takes_drafts(self) -> bool:
        """May speculative decoding draft for it? Not under a constraint that applies after
        the reasoning: where the thinking ends is not known ahead of the draws, so guide
        cannot mask drafted positions."""
        spec = self.structured_outputs
        return spec is None or spec.after_reasoning is None


class PoolingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a pooling request (an embedding, a score) asks of its prompt's vector, as in
    vLLM's PoolingParams; the pool stage computes it (flowllm.models.pooling)."""

    # Matryoshka truncation: the first `dimensions` values, normalized again (None: all).
    dimensions: int | None = None
    normalize: bool | None = None  # L2-normalize the vector (None: as the model's pooler does)
    # A cross-encoder pair: token type 1 from this position on (set by tokenize).
    token_type_start: int | None = None


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """A function call of an assistant turn: `arguments` is JSON text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str


class ChatMessage(msgspec.Struct, frozen=True):
    """One chat turn, its content already flattened to text.

    An assistant turn may carry the tool calls it made, a `tool` turn the id of the call
    it answers."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


# ---------------------------------------------------------------------------------------
# Per request: ingest -> validate -> tokenize -> schedule


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A request as it enters the graph. Exactly one of prompt, prompt_token_ids, messages."""

    request_id: str
    model: str
    params: SamplingParams
    arrival_time: float  # time.monotonic() when the request arrived
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None
    add_generation_prompt: bool = True
    # A template given with the request: rendered within the request-template budget
    # (flowllm/text/chat_template.py). The API admits it only when the server trusts it.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template
    # Chat: the functions the model may call (OpenAI's `tools`, each {"type": "function",
    # "function": {...}}), rendered by the chat template.
    tools: tuple[dict[str, Any], ...] | None = None
    echo: bool = False  # the first chunk carries the prompt text (and its logprobs if asked)
    # Prefix-cache isolation: blocks cached under one salt are never hit by another salt or
    # by requests without one (see flowllm/scheduling/block_pool.py, "Block hashes").
    cache_salt: str | None = None
    # A pooling request (the pooling graph): the prompt's vector instead of generated text.
    pooling: PoolingParams | None = None
    # A cross-encoder's second text: `prompt` and it are tokenized as one pair.
    text_pair: str | None = None


class ValidRequest(msgspec.Struct, frozen=True):
    """A request whose parameters passed validation."""

    request: GenerateRequest


class TokenizedRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A request ready to schedule: prompt tokens known, max_tokens resolved."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams  # max_tokens is an int here
    eos_token_ids: tuple[int, ...]
    arrival_time: float
    prompt_text: str | None = None  # set when the request asked for echo
    cache_salt: str | None = None  # GenerateRequest.cache_salt
    pooling: PoolingParams | None = None  # GenerateRequest.pooling, the pair's split set


class Abort(msgspec.Struct, frozen=True):
    """Stop a request now (client gone, API cancel); schedule frees its blocks at once."""

    request_id: str
    reason: str = "abort"


class Finish(msgspec.Struct, frozen=True):
    """A stop string ended a sequence (sent by detokenize to schedule)."""

    seq_id: int
    stop_reason: str | int | None = None


ErrorKind = Literal["invalid_request", "not_found", "unavailable", "internal"]
"""Why a request cannot be served: the client's input, an unknown model, a server that
cannot take it now (a retry may succeed), or the server's own failure. The HTTP layer
alone turns a kind into a status code (flowllm/api/errors.py)."""


class RequestError(msgspec.Struct, frozen=True, kw_only=True):
    """A request that cannot be served; deliver turns it into the OpenAI error response."""

    request_id: str
    message: str
    kind: ErrorKind = "invalid_request"
    param: str | None = None
    code: str | None = None


# ---------------------------------------------------------------------------------------
# Per step: schedule -> execute -> sample -> (schedule, detokenize) -> deliver


class SeqStart(msgspec.Struct, frozen=True, kw_only=True):
    """What the step loop keeps about a sequence, on the batch of the first step it runs.

    sample reads the parameters, the prompt (penalties, prompt logprobs, the length limit)
    and the EOS ids (the stop rule, min_tokens); guide the constraint and the prompt's
    length; readers of the batch (tracing, trace timelines) map the sequence to its request.
    In a pooling graph, execute reads `pooling` (a cross-encoder pair's token types) and
    pool the rest.
    """

    seq_id: int
    request_id: str
    index: int  # choice index within its request
    params: SamplingParams
    prompt_token_ids: tuple[int, ...]
    eos_token_ids: tuple[int, ...]
    pooling: PoolingParams | None = None  # a pooling request's


PLACEHOLDER_TOKEN = -1  # a token id sampled by a step still in flight (`ScheduledSeq.input_from`)


class ScheduledSeq(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """One sequence's share of a step: which tokens to compute and where their KV goes.

    Scheduled ahead of its last token (async scheduling), a sequence computes that token
    as one placeholder row: `token_ids == (PLACEHOLDER_TOKEN,)`, and `input_from` names the
    (step id, row among that step's sampling rows) whose sampled id execute reads instead.
    Verifying drafts (speculative decoding), it computes its last token and then its
    `num_draft_tokens` drafts, the last tokens of `token_ids`; each of those rows samples.
    """

    seq_id: int
    token_ids: tuple[int, ...]  # the tokens computed this step (a prefill chunk or 1 decode)
    num_computed_tokens: int  # tokens already in the KV cache before this step
    block_table: tuple[int, ...]
    sample: bool  # does this step end at the sequence's last token (so it samples)?
    num_output_tokens: int  # tokens generated so far, in flight included (min/max_tokens)
    input_from: tuple[int, int] | None = None
    num_draft_tokens: int = 0  # drafts at the end of token_ids, verified this step


class ScheduledRows(msgspec.Struct, frozen=True, kw_only=True):
    """A step's rows as columns: row i computes `query_lens[i]` tokens of sequence
    `seq_ids[i]`, at positions from `num_computed_tokens[i]` on.

    Columns rather than a struct per row, so that a step of hundreds of sequences is a few
    tuples to build and read. `token_ids` holds every row's tokens, one row after another.
    A placeholder row (`input_from`) and a row verifying drafts (`num_draft_tokens`) are
    as `ScheduledSeq` describes. `rows[i]` (and iterating) reads a row as a `ScheduledSeq`,
    for code that handles a few rows at a time.
    """

    seq_ids: tuple[int, ...] = ()
    query_lens: tuple[int, ...] = ()  # the tokens each row computes
    token_ids: tuple[int, ...] = ()  # the rows' tokens, row after row
    num_computed_tokens: tuple[int, ...] = ()  # tokens in the KV cache before this step
    block_tables: tuple[tuple[int, ...], ...] = ()
    sample: tuple[bool, ...] = ()  # does the row end at its sequence's last token?
    num_output_tokens: tuple[int, ...] = ()  # generated so far, in flight included
    input_from: dict[int, tuple[int, int]] = {}  # placeholder row -> (step id, sampling row)
    num_draft_tokens: dict[int, int] = {}  # row -> drafts at the end of its tokens

    def __post_init__(self) -> None:
        rows = len(self.seq_ids)
        columns = (
            self.query_lens,
            self.num_computed_tokens,
            self.block_tables,
            self.sample,
            self.num_output_tokens,
        )
        if any(len(c) != rows for c in columns) or sum(self.query_lens) != len(self.token_ids):
            raise ValueError(
                "scheduled rows need one entry per row in every column and "
                f"sum(query_lens) token ids: {rows} rows, column lengths "
                f"{[len(c) for c in columns]}, {len(self.token_ids)} token ids"
            )

    @classmethod
    def of(cls, seqs: Iterable[ScheduledSeq]) -> ScheduledRows:
        """The columns of `seqs`, in order."""
        rows = list(seqs)
        return cls(
            seq_ids=tuple([s.seq_id for s in rows]),
            query_lens=tuple([len(s.token_ids) for s in rows]),
            token_ids=tuple(chain.from_iterable(s.token_ids for s in rows)),
            num_computed_tokens=tuple([s.num_computed_tokens for s in rows]),
            block_tables=tuple([s.block_table for s in rows]),
            sample=tuple([s.sample for s in rows]),
            num_output_tokens=tuple([s.num_output_tokens for s in rows]),
            input_from={i: s.input_from for i, s in enumerate(rows) if s.input_from is not None},
            num_draft_tokens={
                i: s.num_draft_tokens for i, s in enumerate(rows) if s.num_draft_tokens
            },
        )

    def __len__(self) -> int:
        return len(self.seq_ids)

    def __getitem__(self, row: int) -> ScheduledSeq:
        if row < 0:
            row += len(self.seq_ids)
        return self._row(row, sum(self.query_lens[:row]))

    def __iter__(self) -> Iterator[ScheduledSeq]:
        start = 0
        for row, length in enumerate(self.query_lens):
            yield self._row(row, start)
            start += length

    def _row(self, row: int, start: int) -> ScheduledSeq:
        return ScheduledSeq(
            seq_id=self.seq_ids[row],
            token_ids=self.token_ids[start : start + self.query_lens[row]],
            num_computed_tokens=self.num_computed_tokens[row],
            block_table=self.block_tables[row],
            sample=self.sample[row],
            num_output_tokens=self.num_output_tokens[row],
            input_from=self.input_from.get(row),
            num_draft_tokens=self.num_draft_tokens.get(row, 0),
        )


class StepBatch(msgspec.Struct, kw_only=True):
    """Everything one model step computes, in batch order."""

    step_id: int
    rows: ScheduledRows = msgspec.field(default_factory=ScheduledRows)
    started: tuple[SeqStart, ...] = ()
    released: tuple[int, ...] = ()  # seq ids that left since the previous step
    prompt_logits_for: tuple[int, ...] = ()  # seqs whose prompt logits execute returns
    reads_sampled: tuple[int, ...] = ()  # steps whose sampled ids its placeholder rows read
    inflight_from: int = 0  # the oldest step in flight when built: no later batch reads older
    # A sampling row has structured outputs: guide sends this step's masks (only then).
    guided: bool = False


class StepLogits(msgspec.Struct, kw_only=True):
    """The model's logits for the rows that sample, in the order of the sampling seqs: one
    row each, or `num_draft_tokens + 1` consecutive rows for a sequence verifying drafts."""

    batch: StepBatch
    logits: Any  # torch.Tensor [num_sampling_rows, vocab_size], float32
    prompt_logits: dict[int, Any] = {}  # seq_id -> [num_prompt_tokens_this_step, vocab]


class StepHidden(msgspec.Struct, kw_only=True):
    """The model's last hidden states of every row of a step (a pooling graph's execute ->
    pool): token k of row i is row `sum(batch.rows.query_lens[:i]) + k`."""

    batch: StepBatch
    hidden: Any  # torch.Tensor [num_tokens, hidden_size], the model's dtype


class SampledIds(msgspec.Struct, kw_only=True):
    """One step's sampled token ids where the model runs (sample -> execute): what a later
    step's placeholder rows read, without a round trip through the host."""

    step_id: int
    ids: Any  # torch.Tensor [num_sampling_seqs] int64, in the order of the step's sampling rows


class StepMasks(msgspec.Struct, kw_only=True):
    """The allowed next tokens of the step's constrained sampling sequences (guide -> sample).

    Row i of `bitmask` belongs to `seq_ids[i]`; bit j of a row (int32 word j // 32, bit
    j % 32) is set when token j may come next. A sequence that verifies d drafts has d + 1
    consecutive rows, one per position: row j holds what may follow its drafts 0..j-1.
    Sequences without a constraint are absent. Only a step whose batch is `guided` has
    a `StepMasks`; its bitmask is None when no row is masked (every constrained row is
    still in its thinking part).
    """

    step_id: int
    seq_ids: tuple[int, ...] = ()
    bitmask: Any = None  # torch.Tensor [len(seq_ids), ceil(vocab_size / 32)] int32, or None


class TokenLogprobs(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """The logprob of one chosen token and the top-N alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


class SampledToken(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """One sampled token, read on its own: a row of `SampledTokens`."""

    seq_id: int
    token_id: int
    logprobs: TokenLogprobs | None = None
    finish_reason: FinishReason | None = None  # length, EOS or a stop token id
    stop_reason: int | None = None  # the stop token id that ended it, if any


# (finish reason, stop reason) of a row that `SampledTokens.finishes` does not name
NO_FINISH: tuple[None, None] = (None, None)


class SampledTokens(msgspec.Struct, frozen=True, kw_only=True):
    """Sampled tokens as columns: row i is token `token_ids[i]` of sequence `seq_ids[i]`.

    Columns rather than a struct per token, so that a step of hundreds of sequences is a
    few tuples to build, send and read. A sequence that verified drafts has consecutive
    rows, one per accepted draft and one more. `finishes`: row -> (finish reason, the stop
    token id that ended it, if any) of the rows that end their sequence. `logprobs`: one
    entry per row when some row asked for logprobs, else empty.
    """

    seq_ids: tuple[int, ...] = ()
    token_ids: tuple[int, ...] = ()
    finishes: dict[int, tuple[FinishReason, int | None]] = {}
    logprobs: tuple[TokenLogprobs | None, ...] = ()

    def __post_init__(self) -> None:
        rows = len(self.seq_ids)
        if len(self.token_ids) != rows or (self.logprobs and len(self.logprobs) != rows):
            raise ValueError(
                f"sampled tokens need one token id (and logprobs entry, if any) per row: "
                f"{rows} rows, {len(self.token_ids)} ids, {len(self.logprobs)} logprobs"
            )

    @classmethod
    def of(cls, tokens: Iterable[SampledToken]) -> SampledTokens:
        """The columns of `tokens`, in order."""
        rows = list(tokens)
        return cls(
            seq_ids=tuple([t.seq_id for t in rows]),
            token_ids=tuple([t.token_id for t in rows]),
            finishes={
                i: (t.finish_reason, t.stop_reason)
                for i, t in enumerate(rows)
                if t.finish_reason is not None
            },
            logprobs=(
                tuple([t.logprobs for t in rows])
                if any(t.logprobs is not None for t in rows)
                else ()
            ),
        )

    def take(self, rows: Sequence[int]) -> SampledTokens:
        """The given rows, in the order given."""
        finishes = self.finishes
        return SampledTokens(
            seq_ids=tuple([self.seq_ids[i] for i in rows]),
            token_ids=tuple([self.token_ids[i] for i in rows]),
            finishes={j: finishes[i] for j, i in enumerate(rows) if i in finishes},
            logprobs=tuple([self.logprobs[i] for i in rows]) if self.logprobs else (),
        )

    def __len__(self) -> int:
        return len(self.seq_ids)

    def __getitem__(self, row: int) -> SampledToken:
        if row < 0:
            row += len(self.seq_ids)
        finish, stop = self.finishes.get(row, NO_FINISH)
        return SampledToken(
            seq_id=self.seq_ids[row],
            token_id=self.token_ids[row],
            logprobs=self.logprobs[row] if self.logprobs else None,
            finish_reason=finish,
            stop_reason=stop,
        )

    def __iter__(self) -> Iterator[SampledToken]:
        return map(self.__getitem__, range(len(self.seq_ids)))


class StepTokens(msgspec.Struct, kw_only=True):
    """One step's sampled tokens; schedule appends them, detokenize turns them into text.

    `drafts` (added by propose): each sequence's draft tokens for its next step.
    """

    step_id: int
    sampled: SampledTokens = msgspec.field(default_factory=SampledTokens)
    prompt_logprobs: dict[int, tuple[TokenLogprobs | None, ...]] = {}
    drafts: dict[int, tuple[int, ...]] = {}


class ChoiceStart(msgspec.Struct, frozen=True, kw_only=True):
    """What detokenize keeps about a sequence: the step loop's `SeqStart` (the same object)
    and what only the text needs."""

    seq: SeqStart
    prompt_text: str | None = None  # set when the request asked for echo
    scheduled_time: float = 0.0  # time.monotonic() of the step it first ran in

    @property
    def seq_id(self) -> int:
        """`seq.seq_id`: a `started` entry names its sequence, whichever list it is in."""
        return self.seq.seq_id

    @property
    def request_id(self) -> str:
        """`seq.request_id`, likewise."""
        return self.seq.request_id


class ChoiceEvents(msgspec.Struct, kw_only=True):
    """schedule -> detokenize, before the step's batch: choices starting in step `step_id`,
    and choices that ended without a finishing token for detokenize to see (aborted, lost
    in a step-loop restart). A choice whose token or stop string ended it is dropped by
    detokenize itself; this message is sent only when it has something to say."""

    step_id: int
    started: tuple[ChoiceStart, ...] = ()
    ended: tuple[int, ...] = ()


class Chunk(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """New output of one choice since its previous chunk: what a request's mailbox yields.

    The first chunk of a choice carries the prompt (for echo and prompt logprobs); the last
    carries its finish_reason. Pending chunks of a slow reader merge (`merge_chunks`). A
    pooling request has one chunk, its vector in `pooled`.
    """

    request_id: str
    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] = ()
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    prompt_text: str | None = None
    prompt_token_ids: tuple[int, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs | None, ...] = ()
    scheduled_time: float = 0.0  # on a choice's first chunk: ChoiceStart.scheduled_time
    pooled: bytes = b""  # a pooling request's vector: float32, little-endian


def merge_chunks(chunks: Sequence[Chunk]) -> Chunk:
    """Consecutive chunks of one choice, in order, as one: the first's prompt fields, the
    texts, tokens and logprobs of all, the last's finish. Every reader that gathers a
    choice's output (a slow mailbox, a non-streaming response, the offline API) uses this."""
    if len(chunks) == 1:
        return chunks[0]
    # one pass, gathering into lists: half the time of a comprehension per field
    texts: list[str] = []
    token_ids: list[int] = []
    logprobs: list[TokenLogprobs] = []
    add_text = texts.append
    for chunk in chunks:
        add_text(chunk.text)
        token_ids += chunk.token_ids
        if chunk.logprobs:
            logprobs += chunk.logprobs
    last = chunks[-1]
    return msgspec.structs.replace(
        chunks[0],
        text="".join(texts),
        token_ids=tuple(token_ids),
        logprobs=tuple(logprobs),
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        num_output_tokens=last.num_output_tokens,
        pooled=last.pooled,
    )


def merge_by_choice(chunks: Iterable[Chunk]) -> dict[int, Chunk]:
    """A request's chunks, in arrival order, merged per choice index."""
    by_index: dict[int, list[Chunk]] = {}
    for chunk in chunks:
        by_index.setdefault(chunk.index, []).append(chunk)
    return {index: merge_chunks(parts) for index, parts in by_index.items()}


class TextDeltas(msgspec.Struct, kw_only=True):
    """One step's new text, a chunk for every choice that produced any."""

    step_id: int
    chunks: tuple[Chunk, ...]


def request_ids_of(message: object) -> tuple[str, ...]:
    """The requests a message belongs to. Per-step messages name sequences, not requests:
    the stage that knows their requests says (e.g. detokenize's `request_ids`)."""
    if isinstance(message, ValidRequest):
        return (message.request.request_id,)
    if isinstance(message, TextDeltas):
        return tuple(dict.fromkeys(chunk.request_id for chunk in message.chunks))
    request_id = getattr(message, "request_id", None)
    return (request_id,) if isinstance(request_id, str) else ()


def seq_ids_of(message: object) -> tuple[int, ...] | None:
    """The sequences a per-step message names (a step's batch, its logits, its tokens), in
    batch order; None for any other message. Stages and tracing map them to requests."""
    if isinstance(message, StepLogits):
        message = message.batch
    if isinstance(message, StepBatch):
        return message.rows.seq_ids
    if isinstance(message, StepTokens):
        return message.sampled.seq_ids
    return None
