"""audit: one JSON line per request appended to a file, off the request path's event loop.

Insert it on the `tokenize.out -> schedule.requests` edge (examples/graphs/audit.yaml):

    - {name: audit, use: ../stages/audit.py:Audit, with: {path: audit.jsonl}}

Each line holds the request id, the model, the prompt's token count, the sampling
parameters and the arrival time:

    {"id": "cmpl-…-0", "model": "gpt2", "prompt_tokens": 5, "params": {...},
     "arrival_time": 1795315778.123}

Why after tokenize and not right after validate: the prompt's token count exists only once
tokenize has run, and counting again here would tokenize every prompt twice (a chat prompt
renders its template too) on the path this stage must not slow. Everything else is as
exact here: validate has already refused any `model` other than the served one, so the
model is the served name; `params` are every sampling parameter the request runs with
(`max_tokens` resolved to a number when the client left it open); requests refused by
validate or tokenize never run and are not audited.

`arrival_time` is wall-clock (Unix seconds), converted from the graph's monotonic clock.

The stage forwards each request at once and only appends its encoded line to a buffer; a
writer task hands the buffer to a worker thread, which appends the lines to the file and
flushes. Under load one write carries many lines. At most `max_buffered` lines wait: past
that the stage waits for the writer, so a stuck disk slows admission instead of growing
memory without bound. Aborts pass through untouched.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import IO, Any

import anyio
import anyio.to_thread
import msgspec

from flowllm.graph.stage import PerMessageStage, StageContext
from flowllm.messages import Abort, TokenizedRequest


class AuditParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`with:` of the audit stage."""

    path: str  # the JSON lines file, appended to (relative: to the server's working dir)
    max_buffered: int = 10_000  # lines waiting for the writer before the stage waits

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("path must name a file")
        if self.max_buffered < 1:
            raise ValueError("max_buffered must be >= 1")


class Audit(PerMessageStage):
    """Forwards requests unchanged and records one line each (see the module docstring)."""

    inputs = {"in": TokenizedRequest | Abort}
    outputs = {"out": TokenizedRequest | Abort}
    Params = AuditParams

    def __init__(self, params: AuditParams, services: Any) -> None:
        super().__init__(params, services)
        self._model = services.served_model_name
        # Opened now so a bad path stops the server at start, naming this stage.
        self._file: IO[bytes] = Path(params.path).open("ab")  # noqa: SIM115 (run closes it)
        self._encoder = msgspec.json.Encoder()
        self._lines: list[bytes] = []  # encoded lines not yet handed to the writer
        self._wake = anyio.Event()  # set when lines are buffered or the intake ended
        self._written = anyio.Event()  # set after each write, for a stage waiting for room
        self._intake_done = False

    async def run(self, ctx: StageContext) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._writer)
                try:
                    await super().run(ctx)
                finally:
                    self._intake_done = True
                    self._wake.set()
        finally:
            # Only a cancelled graph leaves lines here; a last blocking write is fine then.
            if self._lines:
                self._write(self._lines)
                self._lines = []
            self._file.close()

    async def handle(self, message: TokenizedRequest | Abort, ctx: StageContext) -> None:
        await ctx.emit("out", message)
        if isinstance(message, Abort):
            return
        while len(self._lines) >= self.params.max_buffered:
            await self._written.wait()
        self._lines.append(self.record(message))
        self._wake.set()

    def record(self, request: TokenizedRequest) -> bytes:
        """The request's audit line (JSON, newline-terminated)."""
        wall_arrival = time.time() - (time.monotonic() - request.arrival_time)
        line = self._encoder.encode(
            {
                "id": request.request_id,
                "model": self._model,
                "prompt_tokens": len(request.prompt_token_ids),
                # every parameter, defaults included (msgspec would omit defaults)
                "params": msgspec.structs.asdict(request.params),
                "arrival_time": round(wall_arrival, 6),
            }
        )
        return line + b"\n"

    async def _writer(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            if self._lines:
                lines, self._lines = self._lines, []
                await anyio.to_thread.run_sync(self._write, lines)
                self._written.set()
                self._written = anyio.Event()
            if self._intake_done and not self._lines:
                return

    def _write(self, lines: list[bytes]) -> None:
        self._file.write(b"".join(lines))
        self._file.flush()
