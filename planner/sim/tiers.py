"""The KV cache tiers in the simulator: the scheduler's `tiers` hooks (engine/batch/scheduler.py),
as engine/rank/kv_tiers.py and tier_reads.py answer them, on the simulation's clock.

Each tier keeps the names of the blocks it holds in the engine's own PrefixLRU
(engine/kv/tiers/index.py) at its capacity in blocks (planner/memory.py: its GiB over a rank's
block), and lets go of least-recently-used leaves as the engine's tiers do. Every block named
as a chunk is scheduled is written through to every tier (TierChain with write_through), by one
writer per replica at the tiers' write bandwidth; a block arriving while the writer has more
than its queue holds (a quarter of the host tier, at least 256 MiB) is dropped, as the
engine's is. A prompt whose leading blocks the device
pool lacks asks `held`: the leading names some tier holds are read, each from the highest tier
holding it (a hit there, a miss in each tier above it, and a copy up into them), in
latency + bytes / bandwidth per tier touched (planner/tiers.py), on the replica's one reader
thread (reads queue behind each other). Until then `held` answers None and the prompt steps
aside; from the first tick at or after the read's end `ready` is True and `held` gives the count
of the read blocks that still continue the prompt; a prompt the pool has no room for yet keeps
what it read until its blocks are filled. A shared store is one Store for every replica
of the deployment that has the same layout (the engine's namespace holds the slicing).
"""

from __future__ import annotations

from atoll.engine.kv.tiers.index import PrefixLRU

MIN_PENDING_BYTES = 256 << 20  # engine/rank/kv_tiers.py: the writer's queue, at least this


def pending_bytes(host_bytes: float) -> float:
    """The writer's queue of engine/rank/kv_tiers.RankTiers.build: a quarter of the host tier,
    at least 256 MiB."""
    return max(MIN_PENDING_BYTES, host_bytes // 4)
COUNTS = ("hits", "misses", "evictions", "bytes_in", "bytes_out")


class Store:
    """One tier's held names at `capacity` blocks (None: unbounded) and its counters (the
    engine's atoll_kv_tier_* for this tier)."""

    def __init__(self, name: str, capacity: int | None, speed, block_bytes: float):
        self.name, self.capacity, self.speed, self.block_bytes = name, capacity, speed, block_bytes
        self.index = PrefixLRU()
        self.counts = dict.fromkeys(COUNTS, 0)
        self.fetch_seconds = 0.0

    def __contains__(self, name: bytes) -> bool:
        return name in self.index

    def put(self, name: bytes, parent: bytes | None) -> None:
        self.index.add(name, 1, parent)
        self.counts["bytes_in"] += self.block_bytes
        while self.capacity is not None and len(self.index) > self.capacity:
            self.index.remove(self.index.victim())
            self.counts["evictions"] += 1

    def figures(self) -> dict:
        return {**self.counts, "fetch_seconds": self.fetch_seconds, "blocks": len(self.index)}


class SimTiers:
    """One replica's tiers (every rank holds the same names, each its slice): the scheduler's hooks."""

    def __init__(self, stores: list[Store], clock, block_bytes: float, max_pending: float = MIN_PENDING_BYTES):
        """stores: top first (host, disk, then a shared store other replicas hold too); clock():
        the simulated now (the tick being scheduled); block_bytes: one rank's bytes of a block;
        max_pending: the writer's queue in bytes (pending_bytes)."""
        self.stores, self.clock, self.block_bytes = stores, clock, block_bytes
        self.max_pending = max_pending
        self.kept: dict[int, list[bytes]] = {}  # reads taken by a prompt the pool had no room for yet
        self.holder: int | None = None  # the request of the last `held`
        self.reads: dict[int, tuple[list[bytes], float]] = {}  # request index -> (names read, when done)
        self.again: set[int] = set()
        self.reader_free = 0.0  # when the reader thread is done with the reads queued so far
        self.writer_free = 0.0  # when the writer is done with the blocks queued so far
        self.write_s = sum(block_bytes / s.speed.write_bytes_s for s in stores)  # one block, every tier
        self.dropped = 0

    # --- the scheduler's hooks ---

    def held(self, seq, names: list[bytes]) -> int | None:
        """engine.rank.kv_tiers.RankTiers.held on the simulated clock."""
        index = seq.request.index
        self.holder = index
        if index in self.kept:
            count = continues(self.kept[index], names)
            if count:
                return count
            del self.kept[index]
        if index in self.reads:
            read, done = self.reads[index]
            if done > self.clock():
                return None
            del self.reads[index]
            count = continues(read, names)
            if count:
                self.kept[index] = read
            if count or index in self.again:
                self.again.discard(index)
                return count
            self.again.add(index)  # the pool let go of blocks before the read's first: read again, once
        count = self._lookup(names)
        if count == 0:
            self.again.discard(index)
            return 0
        self.reads[index] = (names[:count], self._fetch(names[:count]))
        return None

    def ready(self, seq) -> bool:
        read = self.reads.get(seq.request.index)
        return read is not None and read[1] <= self.clock()

    def cancel(self, seq) -> None:
        self.again.discard(seq.request.index)
        self.kept.pop(seq.request.index, None)
        self.reads.pop(seq.request.index, None)

    def fill(self, block: int, i: int) -> None:
        """The block's bytes are copied in before the tick: nothing to simulate but the read
        being used up."""
        self.kept.pop(self.holder, None)

    def computed(self, block: int, name: bytes, parent: bytes | None) -> None:
        """Written through to every tier by the writer, unless its queue is full."""
        now = self.clock()
        start = max(now, self.writer_free)
        queued = (start - now) / self.write_s * self.block_bytes if self.write_s > 0 else 0.0
        if queued + self.block_bytes > self.max_pending:
            self.dropped += 1
            return
        self.writer_free = start + self.write_s
        for store in self.stores:
            store.put(name, parent)

    # --- the simulated engine ---

    def next_done(self) -> float | None:
        """When the first read still out ends (None: none is out)."""
        return min((done for _, done in self.reads.values()), default=None)

    def _lookup(self, names: list[bytes]) -> int:
        """How many leading names some tier holds (TierChain.lookup)."""
        for i, name in enumerate(names):
            if not any(name in s for s in self.stores):
                return i
        return len(names)

    def _fetch(self, names: list[bytes]) -> float:
        """Read the blocks (TierChain.fetch's hits, misses and copies up); when the read ends."""
        per_store: dict[int, int] = {}
        for i, name in enumerate(names):
            for level, store in enumerate(self.stores):
                if name not in store:
                    store.counts["misses"] += 1
                    continue
                store.index.touch(name)
                store.counts["hits"] += 1
                store.counts["bytes_out"] += self.block_bytes
                per_store[level] = per_store.get(level, 0) + 1
                for up in self.stores[:level]:  # a copy up, so the next hit is nearer
                    up.put(name, names[i - 1] if i else None)
                break
        seconds = 0.0
        for level, n in per_store.items():
            store = self.stores[level]
            s = store.speed.read_s(n * self.block_bytes)
            store.fetch_seconds += s
            seconds += s
        start = max(self.clock(), self.reader_free)
        self.reader_free = start + seconds
        return self.reader_free


def continues(read: list[bytes], names: list[bytes]) -> int:
    """How many of the read blocks continue `names` (tier_reads.Reads.take: the blocks the
    prompt still needs, which the device pool may have changed since the read began)."""
    if not names or names[0] not in read:
        return 0
    k, n = read.index(names[0]), 0
    for have, want in zip(read[k:], names):
        if have != want:
            break
        n += 1
    return n


def figures(tiers: list[SimTiers]) -> dict[str, dict]:
    """Per tier name, summed over the replicas' stores (a shared store counted once)."""
    out: dict[str, dict] = {}
    seen: set[int] = set()
    for t in tiers:
        for s in t.stores:
            if id(s) in seen:
                continue
            seen.add(id(s))
            acc = out.setdefault(s.name, {})
            for k, v in s.figures().items():
                acc[k] = acc.get(k, 0) + v
    return out
