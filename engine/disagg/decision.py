"""Which engine computes a prompt, in plain Python over token ids and block names (no torch, no
ranks: the planner's simulator makes the same decision).

A prompt goes to a prefill engine only when the part of it that its decode replica has not
cached is at least `min_prompt_tokens` long, the prefill queue has room and the decode engine
is not colocated; otherwise its decode engine prefills it itself ("decode": short or mostly
cached; "queue": the prefill engines' queue was full; "colocated": one of the last
--colocated-replicas decode engines, replicas beside the xPyD ones, which prefill every prompt
they take). A prompt's cached part is the run of its full blocks whose names the replica holds,
never the block of its last token, which is computed for the first token.
With a shared KV store, blocks any engine of the decode engines' slicing wrote there count as
held too: the decode engine reads them up instead of computing them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from atoll.engine.kv.blocks import prefix_names


def uncached_tokens(ids: list[int], seen: set[bytes], *, block_size: int, prefix_caching: bool,
                    remember: bool = True) -> int:
    """The prompt tokens an engine that has seen the blocks named in `seen` still computes,
    and `ids`' full blocks added to `seen` (with prefix caching, when `remember`: a fixed
    list's prediction). Never the last token's block (Scheduler._admit): it is computed for
    the first token."""
    if not prefix_caching:
        return len(ids)
    names, hits = prefix_names(ids, block_size, (len(ids) - 1) // block_size), 0
    while hits < len(names) and names[hits] in seen:
        hits += 1
    if remember:
        seen.update(names)
    return len(ids) - hits * block_size


class Either:
    """Block names held by any of several sets (a decode replica's pool, the shared KV store),
    for `uncached_tokens`' `seen`."""

    def __init__(self, *sets):
        self.sets = sets

    def __contains__(self, name) -> bool:
        return any(name in s for s in self.sets)


class Recent:
    """The last `limit` names added, oldest dropped first: what the driver knows the shared KV
    store holds (names the engines wrote there), bounded in memory."""

    def __init__(self, limit: int = 1 << 20):
        self.limit, self._names = limit, {}

    def add(self, name: bytes) -> None:
        self._names.pop(name, None)
        self._names[name] = None
        if len(self._names) > self.limit:
            del self._names[next(iter(self._names))]

    def __contains__(self, name) -> bool:
        return name in self._names

    def __len__(self) -> int:
        return len(self._names)


@dataclass(frozen=True)
class Path:
    remote: bool  # a prefill engine computes the prompt
    prefill: int  # which one (the least waiting); meaningful when remote
    reason: str  # "prefill", "decode" (short or cached), "queue" (the prefill queue was full) or "colocated"


def choose_path(new_tokens: int, waiting: list[float], *, min_prompt_tokens: int,
                max_prefill_queue: int | None, colocated: bool = False) -> Path:
    """The path of a prompt with `new_tokens` uncached tokens, given each prefill engine's
    requests not yet handed off (math.inf for a dead engine). A prompt bound for a colocated
    decode engine (--colocated-replicas) is always prefilled there."""
    prefill = waiting.index(min(waiting))
    if colocated:
        return Path(False, prefill, "colocated")
    live = [w for w in waiting if w != math.inf]
    full = not live or (max_prefill_queue is not None and sum(live) >= max_prefill_queue)
    long_enough = new_tokens >= min_prompt_tokens
    remote = long_enough and not full
    return Path(remote, prefill, "prefill" if remote else "queue" if long_enough else "decode")

