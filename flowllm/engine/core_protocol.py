"""What the front processes and the engine core say to each other besides channel traffic.

A front connects to the core's socket and greets it (`Hello`); the core answers
with what the front's stages need to know of the model (`CoreReady`), then sends a
`Heartbeat` every `HEARTBEAT_INTERVAL_S`, and its metrics when a front asks for them
(`MetricsQuery`, for a scrape of /metrics or the web page's live view). With several
fronts the core first asks the others for theirs (the same query, the other way) and
sends them along, so that whichever front a scrape reaches counts every front's requests.
A request the core fails outside a channel (a step-loop stage without an `errors` port)
travels as `FailRequest`. A front's validate stage has the core compile a request's
constraint (`CheckGrammar`, answered by `GrammarChecked`): the core holds the grammar
engine, whose import (torch) a front never pays, and keeps what it compiled for its guide
stage. All are control frames (flowllm/graph/wire.py).
"""

from __future__ import annotations

import msgspec

from flowllm.engine.span_relay import Spans, WantSpans
from flowllm.messages import RequestError, StructuredOutputs
from flowllm.models.pooler_config import PoolerConfig

HEARTBEAT_INTERVAL_S = 0.1
METRICS_TIMEOUT_S = 1.0  # a core this slow to answer: the front renders without it
SIBLING_METRICS_TIMEOUT_S = 0.5  # a front this slow to answer the core: left out
# A front whose core has not beaten for this long answers /health with 503: a core
# stuck (its event loop or a step) is as unavailable as a dead one.
HEARTBEAT_STALE_S = 1.0
# A constraint the core has not compiled in this long gets a 503: under the validate
# stage's watchdog (10 s in the default graph), which would otherwise restart the stage.
GRAMMAR_CHECK_TIMEOUT_S = 8.0


class Hello(msgspec.Struct, frozen=True, tag=True):
    front: int  # which front this is, 0 .. api_server_count - 1
    wiring: str  # the graph's wiring digest: both ends run the same graph
    pid: int
    # The core's secret, for a core on TCP (a Ray replica's): only its own front is
    # served, not whoever reaches the port (nor a front that found another core there).
    token: str = ""


class CoreReady(msgspec.Struct, frozen=True, tag=True):
    """The model facts the front's stages read (validation, tokenization, detokenization)."""

    max_model_len: int
    vocab_size: int  # the model's logits width
    eos_token_ids: tuple[int, ...]
    num_blocks: int
    pid: int
    healthy: bool  # as a `Heartbeat` says: the front may serve at once
    pooler: PoolerConfig | None = None  # a model served for pooling: what requests may ask


class Refused(msgspec.Struct, frozen=True, tag=True):
    reason: str


class Heartbeat(msgspec.Struct, frozen=True, tag=True):
    healthy: bool


class MetricsQuery(msgspec.Struct, frozen=True, tag=True):
    query: int


class MetricsReply(msgspec.Struct, frozen=True, tag=True):
    query: int
    text: bytes  # the sender's registry as Prometheus text
    fronts: tuple[bytes, ...] = ()  # in the core's reply: the other fronts' registries


class FailRequest(msgspec.Struct, frozen=True, tag=True):
    error: RequestError


class CheckGrammar(msgspec.Struct, frozen=True, tag=True):
    query: int
    spec: StructuredOutputs


class GrammarChecked(msgspec.Struct, frozen=True, tag=True):
    query: int
    message: str | None = None  # why the constraint does not compile; None: it does
    param: str = ""  # the request field it came from


Control = (
    Hello
    | CoreReady
    | Refused
    | Heartbeat
    | MetricsQuery
    | MetricsReply
    | FailRequest
    | CheckGrammar
    | GrammarChecked
    | Spans
    | WantSpans
)
CONTROL_DECODER = msgspec.msgpack.Decoder(Control)
