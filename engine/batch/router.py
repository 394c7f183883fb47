"""Which replica takes a request: cache-aware (the longest cached prefix) or round-robin.

The cache-aware router keeps, for every replica, the prefix blocks it holds: names
(engine.kv.blocks.prefix_names, the engines' own block hashes). Where the engines report their
cache events (`observe`: each block their pools name or evict, as `atoll serve`'s replicas do),
those are the record: a block is held from the event that names it to the one that evicts it,
generated tokens' blocks included, and a replica with KV tiers below its pool keeps an evicted
block there, counted at half the weight of one in its device pool (it is brought up, not
computed). From a request's routing until it ends (`settle`), the router counts its prompt's
blocks as held there whatever the events say (the request computes them if they are gone), so
requests sent together with one prefix go together.
Without events (`events=False`: the simulator, whose engines run the same pools) the record is
the router's own model: the full prompt blocks of every request it sent, in least-recently-used
order, at most as many as the replica's KV cache has blocks, which goes wrong when an engine
evicts early (its running requests took the room).

Rule: the replica whose model holds the most leading blocks of the prompt (the block of its
last token excluded: the engine always computes that one); among equals the least loaded.
"Least loaded" is the fewest unfinished requests, and among equals the replica whose cache
(as modelled) holds the fewest blocks, so new prefixes spread over the replicas' caches.
Where no replica holds any, or the best one has `imbalance` more unfinished requests than
the least loaded (serve.replicas: a quarter of a batch, max_num_seqs / 4), the least-loaded
replica takes it, and from then on both hold the prefix in the model and share its requests
by load.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace

from atoll.engine.kv.blocks import prefix_names

# sent_prefix: the cache-aware rule over the router's own model of what it sent (events=False),
# kept so that routing by the engines' events can be measured against it
ROUTERS = ("cache_aware", "round_robin", "sent_prefix")


@dataclass(frozen=True)
class Route:
    replica: int
    reason: str  # prefix, least_loaded, balance, round_robin
    hit_tokens: int  # prompt tokens the router expects the replica to have cached
    names: tuple = field(default=(), compare=False, repr=False)  # the names of the prompt's full blocks it computed (the engine's own; the simulator reuses them)


class CacheModel:
    """One replica's cached prefix blocks as the router sees them: names, oldest first; with
    events, `below` holds the blocks its pool evicted into its KV tiers."""

    def __init__(self, capacity: int | None):
        self.capacity = None if capacity is None else max(1, capacity)  # None: the engine's events trim it
        self.names: OrderedDict[bytes, None] = OrderedDict()
        self.below: set[bytes] = set()
        self.pending: dict[bytes, int] = {}  # with events: names of requests routed here and not yet ended

    def holds(self, name: bytes) -> bool:
        return name in self.names or name in self.pending

    def deeper(self, names: list[bytes], start: int) -> int:
        """How many names from `start` on are held below the pool, leading."""
        n = start
        while n < len(names) and names[n] in self.below and not self.holds(names[n]):
            n += 1
        return n - start

    def match(self, names: list[bytes]) -> int:
        """How many leading names are held (or on their way: a request routed here computes them)."""
        n = 0
        while n < len(names) and self.holds(names[n]):
            n += 1
        return n

    def touch(self, names: list[bytes]) -> None:
        """The replica computed (or reused) these blocks: newest now; the oldest beyond the
        capacity are forgotten, as the engine's pool evicts least-recently-used first."""
        for name in names:
            self.names[name] = None
            self.names.move_to_end(name)
        while self.capacity is not None and len(self.names) > self.capacity:
            self.names.popitem(last=False)

    def clear(self) -> None:
        self.names.clear()
        self.below.clear()
        self.pending.clear()


BELOW_WEIGHT = 0.5  # a block in a replica's KV tiers against one in its device pool


class CacheAwareRouter:
    def __init__(self, capacities: list[int], *, block_size: int, imbalance: int, events: bool = False,
                 tiers: list[bool] | None = None):
        """events: the engines report their cache events (observe), which are the record;
        tiers: which replicas keep evicted blocks in KV tiers below their pool."""
        self.block_size, self.imbalance, self.events = block_size, imbalance, events
        self.name = "cache_aware" if events else "sent_prefix"
        self.models = [CacheModel(None if events else c) for c in capacities]
        self.tiers = tiers or [False] * len(capacities)
        self._lock = threading.Lock()  # events come from the engines' threads

    def observe(self, replica: int, events) -> None:
        """Replica `replica`'s pools named (True, name) or evicted (False, name) these blocks."""
        model = self.models[replica]
        with self._lock:
            for named, name in events:
                if named:
                    model.touch([name])
                    model.below.discard(name)
                else:
                    model.names.pop(name, None)
                    if self.tiers[replica]:
                        model.below.add(name)

    def choose(self, tokens: list[int], loads: list[int], alive: list[int]) -> Route:
        """loads[r]: replica r's unfinished requests; alive: the replicas that may take it."""
        with self._lock:
            return self._choose(tokens, loads, alive)

    def _choose(self, tokens: list[int], loads: list[int], alive: list[int]) -> Route:
        full = prefix_names(tokens, self.block_size)  # every full block, for the model below
        names = full[:(len(tokens) - 1) // self.block_size]  # the last token's block is always computed
        hits = {}
        for r in alive:
            held = self.models[r].match(names)
            hits[r] = held + BELOW_WEIGHT * self.models[r].deeper(names, held)
        # the least loaded; among equals the one whose cache holds least, so new prefixes spread
        least = min(alive, key=lambda r: (loads[r], len(self.models[r].names), r))
        best = max(hits.values())
        if best == 0:
            route = Route(least, "least_loaded", 0)
        else:
            pick = min((r for r in alive if hits[r] == best), key=lambda r: (loads[r], r))
            if loads[pick] - loads[least] >= self.imbalance:
                route = Route(least, "balance", int(hits[least] * self.block_size))
            else:
                route = Route(pick, "prefix", int(best * self.block_size))
        model = self.models[route.replica]
        if self.events:  # held from now until the request ends (settle), or its engine reports them
            for name in full:
                model.pending[name] = model.pending.get(name, 0) + 1
        else:
            model.touch(full)
        return replace(route, names=tuple(full))

    def settle(self, replica: int, names) -> None:
        """A request routed to `replica` ended: its prompt's blocks are held there only as its
        engine's events say."""
        if not self.events:
            return
        with self._lock:
            pending = self.models[replica].pending
            for name in names:
                left = pending.get(name, 0) - 1
                if left > 0:
                    pending[name] = left
                else:
                    pending.pop(name, None)

    def forget(self, replica: int) -> None:
        """The replica died: it holds nothing."""
        with self._lock:
            self.models[replica].clear()


class RoundRobinRouter:
    name = "round_robin"

    def __init__(self):
        self._next = 0

    def choose(self, tokens: list[int], loads: list[int], alive: list[int]) -> Route:
        ordered = sorted(alive)
        pick = next((r for r in ordered if r >= self._next), ordered[0])
        self._next = pick + 1
        return Route(pick, "round_robin", 0)

    def forget(self, replica: int) -> None:
        pass

    def settle(self, replica: int, names) -> None:
        pass


def make_router(kind: str, *, capacities: list[int], block_size: int, imbalance: int, events: bool = False,
                tiers: list[bool] | None = None):
    if kind in ("cache_aware", "sent_prefix"):
        return CacheAwareRouter(capacities, block_size=block_size, imbalance=imbalance,
                                events=events and kind == "cache_aware", tiers=tiers)
    if kind == "round_robin":
        return RoundRobinRouter()
    raise ValueError(f"router {kind!r}: choose one of {', '.join(ROUTERS)}")
