"""Which replica takes a request: cache-aware (the longest cached prefix) or round-robin.

The cache-aware router keeps, for every replica, a model of the prefix blocks it holds: the
names (engine.kv.blocks.prefix_names, the engines' own block hashes) of the full prompt blocks
of every request it sent there, in least-recently-used order, at most as many as the
replica's KV cache has blocks. It is the router's own bookkeeping, not the engines' report:
a block the engine evicted early (its running requests took the room) or never computed (the
request was aborted before its prefill) still counts here until the model evicts it, and the
blocks of generated tokens are not counted. What the engines really served from their
caches is `cached_tokens` in each response and atoll_prefix_cache_hit_rate in /metrics.

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

from collections import OrderedDict
from dataclasses import dataclass, field, replace

from atoll.engine.kv.blocks import prefix_names

ROUTERS = ("cache_aware", "round_robin")


@dataclass(frozen=True)
class Route:
    replica: int
    reason: str  # prefix, least_loaded, balance, round_robin
    hit_tokens: int  # prompt tokens the router expects the replica to have cached
    names: tuple = field(default=(), compare=False, repr=False)  # the names of the prompt's full blocks it computed (the engine's own; the simulator reuses them)


class CacheModel:
    """One replica's cached prefix blocks as the router sees them: names, oldest first."""

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self.names: OrderedDict[bytes, None] = OrderedDict()

    def match(self, names: list[bytes]) -> int:
        """How many leading names are held."""
        n = 0
        while n < len(names) and names[n] in self.names:
            n += 1
        return n

    def touch(self, names: list[bytes]) -> None:
        """The replica computed (or reused) these blocks: newest now; the oldest beyond the
        capacity are forgotten, as the engine's pool evicts least-recently-used first."""
        for name in names:
            self.names[name] = None
            self.names.move_to_end(name)
        while len(self.names) > self.capacity:
            self.names.popitem(last=False)

    def clear(self) -> None:
        self.names.clear()


class CacheAwareRouter:
    name = "cache_aware"

    def __init__(self, capacities: list[int], *, block_size: int, imbalance: int):
        self.block_size, self.imbalance = block_size, imbalance
        self.models = [CacheModel(c) for c in capacities]

    def choose(self, tokens: list[int], loads: list[int], alive: list[int]) -> Route:
        """loads[r]: replica r's unfinished requests; alive: the replicas that may take it."""
        full = prefix_names(tokens, self.block_size)  # every full block, for the model below
        names = full[:(len(tokens) - 1) // self.block_size]  # the last token's block is always computed
        hits = {r: self.models[r].match(names) for r in alive}
        # the least loaded; among equals the one whose cache holds least, so new prefixes spread
        least = min(alive, key=lambda r: (loads[r], len(self.models[r].names), r))
        best = max(hits.values())
        if best == 0:
            route = Route(least, "least_loaded", 0)
        else:
            pick = min((r for r in alive if hits[r] == best), key=lambda r: (loads[r], r))
            if loads[pick] - loads[least] >= self.imbalance:
                route = Route(least, "balance", hits[least] * self.block_size)
            else:
                route = Route(pick, "prefix", best * self.block_size)
        self.models[route.replica].touch(full)
        return replace(route, names=tuple(full))

    def forget(self, replica: int) -> None:
        """The replica died: it holds nothing."""
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


def make_router(kind: str, *, capacities: list[int], block_size: int, imbalance: int):
    if kind == "cache_aware":
        return CacheAwareRouter(capacities, block_size=block_size, imbalance=imbalance)
    if kind == "round_robin":
        return RoundRobinRouter()
    raise ValueError(f"router {kind!r}: choose one of {', '.join(ROUTERS)}")
