"""What the step loop owes the rest of the graph, kept where a restart cannot lose it.

A step loop that fails is built anew and its stages' state thrown away, as an Erlang/OTP
supervisor throws a crashed child's away. What must outlive it is recorded here as it
happens, and the supervisor keeps this record for the next incarnation (the schedule
stage's `ctx.keep`), so a restart reads the record and never the scheduler that failed,
whatever that one was doing when it failed:

- the requests admitted whose sequences have not started: they run again as if nothing
  happened; the requests whose sequences started: their KV blocks and sampler state are
  gone, so they are answered with an error;
- the sequence ids stages outside the loop may still hold: released in the next batch
  (and the ones released in a batch whose tokens never came back), and ended for
  detokenize where it saw no finishing token;
- the id counters, so no sequence or step id is used twice, and the cumulative counters
  the metrics read, so they never go back;
- the aborts that came before their request.
"""

from __future__ import annotations

from collections import OrderedDict

from flowllm.messages import TokenizedRequest

EARLY_ABORTS_KEPT = 4096


class Ledger:
    """The scheduler writes each fact here as it happens; `after_failure` turns the record
    into what a fresh scheduler takes on."""

    def __init__(self) -> None:
        self.unstarted: dict[str, TokenizedRequest] = {}  # admitted, no sequence started
        self.started: dict[str, None] = {}  # requests with a sequence started, in order
        self.live: set[int] = set()  # started sequences not finished
        self.released: list[int] = []  # started seq ids that left since the last batch
        # step id -> the released ids its batch carries, until the step's tokens come back
        self.releases_in_flight: dict[int, tuple[int, ...]] = {}
        # started sequences that ended without a finishing token, for the next ChoiceEvents
        self.choices_ended: list[int] = []
        self.next_seq_id = 0
        self.next_step_id = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up at admission
        self.prefix_cache_hits = 0  # of those, tokens found in the cache
        self.num_preemptions = 0
        self._early_aborts: OrderedDict[str, None] = OrderedDict()

    def admitted(self, request: TokenizedRequest) -> None:
        self.unstarted[request.request_id] = request

    def seq_started(self, request_id: str, seq_id: int) -> None:
        if self.unstarted.pop(request_id, None) is not None:
            self.started[request_id] = None
        self.live.add(seq_id)

    def seq_finished(self, seq_id: int) -> None:
        self.live.discard(seq_id)

    def request_finished(self, request_id: str) -> None:
        """Every sequence of the request finished: nothing of it is owed any more."""
        self.unstarted.pop(request_id, None)
        self.started.pop(request_id, None)

    def step_applied(self, step_id: int) -> None:
        """A step's tokens came back: what its batch released reached every stage."""
        self.releases_in_flight.pop(step_id, None)

    def abort_before_arrival(self, request_id: str) -> None:
        """Remember an abort whose request has not come (the most recent ones kept)."""
        self._early_aborts[request_id] = None
        if len(self._early_aborts) > EARLY_ABORTS_KEPT:
            self._early_aborts.popitem(last=False)

    def take_early_abort(self, request_id: str) -> bool:
        """Whether the arriving request was aborted before it came (forgotten now)."""
        return self._early_aborts.pop(request_id, 0) is None

    def after_failure(self) -> tuple[list[TokenizedRequest], list[str]]:
        """The step loop failed: the requests to run again and the ids of those lost. From
        here on the record owes the rest of the graph every started sequence, ended and
        released in the fresh scheduler's first batch, and the releases of batches whose
        tokens never came back."""
        requeue, lost = list(self.unstarted.values()), list(self.started)
        in_flight = [i for ids in self.releases_in_flight.values() for i in ids]
        self.released = list(dict.fromkeys([*in_flight, *self.released, *self.live]))
        self.choices_ended = list(dict.fromkeys([*self.choices_ended, *self.live]))
        self.releases_in_flight.clear()
        self.unstarted.clear()
        self.started.clear()
        self.live.clear()
        return requeue, lost
