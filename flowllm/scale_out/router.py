"""Which engine replica serves a request: prefix affinity, or round robin for comparison.

Prefix affinity sends a request to the replica that most likely holds its prompt's
leading KV blocks: the router remembers, per replica, the chained hashes of the prompt
blocks it sent there (an LRU as large as that replica's KV cache) and picks the replica
with the longest match. Two guards keep it from piling work on one replica: when the
replicas' in-flight requests differ by more than `imbalance_bound`, or nothing matches,
it takes the less loaded of two replicas drawn at random ("power of two choices").

Blocks are cut from the request before a front tokenizes it: token ids when the
client sent them (`block_size` tokens a block), otherwise the prompt's UTF-8 bytes
(`BYTES_PER_TOKEN` x `block_size` a block), chat messages as role and content. Equal
leading text gives equal leading tokens, so equal blocks here mean equal KV blocks there;
the byte blocks only approximate where the token blocks end.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal, Protocol

from flowllm.messages import GenerateRequest

ROUTING_POLICIES = ("prefix_aware", "round_robin")
# Routing decisions, the label of the routing metrics.
Decision = Literal["prefix_match", "no_match", "imbalanced", "round_robin"]
DECISIONS: tuple[Decision, ...] = ("prefix_match", "no_match", "imbalanced", "round_robin")
BYTES_PER_TOKEN = 4  # ~ bytes of English text per BPE token
MAX_ROUTING_BLOCKS = 512  # leading blocks hashed per prompt: bounds the router's work


class Replica(Protocol):
    """What routing reads of a replica."""

    @property
    def index(self) -> int: ...

    @property
    def in_flight(self) -> int: ...


def prompt_blocks(request: GenerateRequest, block_size: int) -> list[int]:
    """Chained hashes of the request's full leading blocks (a block's hash covers every
    block before it, as the KV cache's do)."""
    if request.prompt_token_ids is not None:
        tokens = request.prompt_token_ids
        pieces = [
            hash(tokens[i : i + block_size])
            for i in range(0, min(len(tokens), MAX_ROUTING_BLOCKS * block_size), block_size)
            if i + block_size <= len(tokens)
        ]
    else:
        if request.prompt is not None:
            text = request.prompt
        else:
            text = "".join(f"{m.role}\x00{m.content}\x00" for m in request.messages or ())
        size = block_size * BYTES_PER_TOKEN
        data = text.encode("utf-8", "surrogatepass")[: MAX_ROUTING_BLOCKS * size]
        pieces = [hash(data[i : i + size]) for i in range(0, len(data) - size + 1, size)]
    chained: list[int] = []
    previous = hash(request.cache_salt)
    for piece in pieces:
        previous = hash((previous, piece))
        chained.append(previous)
    return chained


class PrefixTable:
    """The block hashes sent to one replica, least recently used first, at most `capacity`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def match(self, blocks: Sequence[int]) -> int:
        """How many leading blocks of `blocks` this replica was sent."""
        matched = 0
        for block in blocks:
            if block not in self._blocks:
                break
            matched += 1
        return matched

    def add(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self._blocks[block] = None
            self._blocks.move_to_end(block)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()


class Route:
    """A routing decision: the replica, why, and the prompt blocks it matched there."""

    __slots__ = ("decision", "matched_blocks", "queried_blocks", "replica")

    def __init__(
        self, replica: Replica, decision: Decision, matched_blocks: int, queried_blocks: int
    ) -> None:
        self.replica = replica
        self.decision = decision
        self.matched_blocks = matched_blocks
        self.queried_blocks = queried_blocks


class Router:
    """Chooses replicas by `policy` (one of ROUTING_POLICIES) and remembers their prefixes.

    `capacities[i]`: replica i's KV blocks; `imbalance_bound`: the largest difference in
    in-flight requests between replicas at which prefix affinity still decides.
    """

    def __init__(
        self,
        policy: str,
        capacities: Sequence[int],
        block_size: int,
        imbalance_bound: int,
        rng: random.Random | None = None,
    ) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {policy!r}")
        if imbalance_bound < 0:
            raise ValueError(f"the imbalance bound must be >= 0, got {imbalance_bound}")
        self.policy = policy
        self.block_size = block_size
        self.imbalance_bound = imbalance_bound
        self._tables = [PrefixTable(capacity) for capacity in capacities]
        self._rng = rng or random.Random()
        self._next = 0  # round robin's next replica index

    def forget(self, index: int) -> None:
        """Replica `index` restarted: its cache is empty."""
        self._tables[index].clear()

    def choose(self, requests: Sequence[GenerateRequest], replicas: Sequence[Replica]) -> Route:
        """The replica for one API request's sub-requests (they stay together), among
        `replicas` (the healthy ones, never empty); records their blocks there."""
        if not replicas:
            raise ValueError("no replica to route to")
        blocks = prompt_blocks(requests[0], self.block_size)
        matches = {r.index: self._tables[r.index].match(blocks) for r in replicas}
        route = self._decide(replicas, matches)
        route.queried_blocks = len(blocks)
        table = self._tables[route.replica.index]
        table.add(blocks)
        for request in requests[1:]:
            table.add(prompt_blocks(request, self.block_size))
        return route

    def _decide(self, replicas: Sequence[Replica], matches: dict[int, int]) -> Route:
        if self.policy == "round_robin":
            ordered = sorted(replicas, key=lambda r: (r.index - self._next) % len(self._tables))
            chosen = ordered[0]
            self._next = (chosen.index + 1) % len(self._tables)
            return Route(chosen, "round_robin", matches[chosen.index], 0)
        loads = [r.in_flight for r in replicas]
        if max(loads) - min(loads) > self.imbalance_bound:
            chosen = self._two_choices(replicas)
            return Route(chosen, "imbalanced", matches[chosen.index], 0)
        best = max(matches.values())
        if best == 0:
            chosen = self._two_choices(replicas)
            return Route(chosen, "no_match", 0, 0)
        candidates = [r for r in replicas if matches[r.index] == best]
        chosen = min(candidates, key=lambda r: r.in_flight)
        return Route(chosen, "prefix_match", best, 0)

    def _two_choices(self, replicas: Sequence[Replica]) -> Replica:
        if len(replicas) == 1:
            return replicas[0]
        first, second = self._rng.sample(list(replicas), 2)
        return first if first.in_flight <= second.in_flight else second
