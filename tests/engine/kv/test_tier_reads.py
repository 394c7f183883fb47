"""A prompt's blocks read from the KV tiers while the engine goes on (engine/rank/tier_reads.py,
the scheduler's `loading`): the prompt steps aside until every rank's read is done, the other
sequences keep their ticks, and a read whose request left is dropped."""

import threading

from atoll.comm.group import Group
from atoll.engine.batch.request import Request
from atoll.engine.batch.scheduler import Scheduler, Sequence
from atoll.engine.kv.blocks import BlockPool, prefix_names
from atoll.engine.kv.tiers.chain import TierChain
from atoll.engine.kv.tiers.host import HostTier
from atoll.engine.rank.kv_tiers import RankTiers
from atoll.engine.rank.tier_reads import Reads
from atoll.engine.sample.sampler import SamplerState, SamplingParams

BS = 4
NS = b"n" * 16


class SlowHost(HostTier):
    """A host tier whose reads wait for `go` (a slow disk or network, held open by the test)."""

    def __init__(self, capacity):
        super().__init__(capacity)
        self.go = threading.Event()

    def get(self, name):
        assert self.go.wait(10)
        return super().get(name)


class Hooks(RankTiers):
    """The scheduler's tiers hooks as a rank has them (engine/rank/kv_tiers.RankTiers) over a
    real Reads, with no cache: what `fill` gives a block is recorded instead."""

    def __init__(self, reads):
        super().__init__(reads.chain, reads, size=8)
        self.filled = []

    def fill(self, block, i):
        super().fill(block, i)
        self.filled.append(self._fills.pop())


def _stored(chain) -> list[int]:
    """A 13-token prompt whose three full blocks the chain holds (payload i for block i); the
    last token's block is computed."""
    prompt = list(range(1, 14))
    names = prefix_names(prompt, BS)
    for i, name in enumerate(names):
        chain.offload(name, names[i - 1] if i else None, bytes([i]) * 8)
    assert chain.flush(5)
    return prompt


def _seq(i, tokens):
    req = Request(i, tokens, SamplingParams(max_tokens=8))
    return Sequence(req, SamplerState(req.params))


def test_a_prompt_waits_for_its_read_while_the_others_decode():
    tier = SlowHost(1 << 20)
    chain = TierChain([tier], NS)
    prompt = _stored(chain)
    reads = Reads(chain, Group.single(), "cpu")
    hooks = Hooks(reads)
    sched = Scheduler(BlockPool(32, BS), max_num_seqs=4, max_num_batched_tokens=64, prefix_caching=True, tiers=hooks)
    other = _seq(0, [50, 51, 52])
    sched.add(other)
    first = sched.schedule(0)
    assert [c.seq for c in first] == [other]
    other.cached = 3
    other.output.append(9)
    sched.add(_seq(1, prompt))
    for step in range(1, 4):  # its read is held: it steps aside, the other decodes
        reads.poll()
        chunks = sched.schedule(step)
        assert [c.seq.request.index for c in chunks] == [0] and len(sched.loading) == 1
        other.cached += 1
        other.output.append(9)
    tier.go.set()
    for step in range(4, 200):
        reads.idle()  # as the engine's empty ticks wait for a read
        reads.poll()
        if reads.ready(1):
            break
    chunks = sched.schedule(step)
    mine = next(c for c in chunks if c.seq.request.index == 1)
    assert mine.start == 12 and mine.seq.cached_tokens == 12  # three blocks from the tier
    assert [p for _, p in hooks.filled] == [bytes([i]) * 8 for i in range(3)]
    reads.close()
    chain.close()


def test_a_read_whose_request_left_is_dropped():
    tier = SlowHost(1 << 20)
    chain = TierChain([tier], NS)
    names = prefix_names(list(range(1, 10)), BS)
    for i, name in enumerate(names):
        chain.offload(name, names[i - 1] if i else None, b"x" * 8)
    assert chain.flush(5)
    reads = Reads(chain, Group.single(), "cpu")
    assert reads.start(5, names) and reads.reading(5)
    reads.cancel(5)
    tier.go.set()
    for _ in range(200):
        reads.idle()
        reads.poll()
        if not reads.reading(5):
            break
    assert not reads.reading(5) and not reads.ready(5)
    assert not reads.start(6, [b"y" * 16])  # nothing held: no read
    reads.close()
    chain.close()


def test_a_request_that_leaves_after_its_read_lets_go_of_the_blocks_read():
    """A prompt whose read finished waits at the head of the line while max_num_seqs is full (the
    next prompt ran while it read); if it leaves then (an abort), the payloads read for it go."""
    chain = TierChain([HostTier(1 << 20)], NS)
    prompt = _stored(chain)
    reads = Reads(chain, Group.single(), "cpu")
    sched = Scheduler(BlockPool(32, BS), max_num_seqs=1, max_num_batched_tokens=64, prefix_caching=True,
                      tiers=Hooks(reads))
    mine, other = _seq(1, prompt), _seq(2, [50, 51, 52])
    sched.add(mine)
    sched.add(other)
    assert [c.seq for c in sched.schedule(0)] == [other] and sched.loading == [mine]  # it steps aside
    other.cached = 3
    other.output.append(9)
    for _ in range(200):
        reads.idle()
        reads.poll()
        if reads.ready(1):
            break
    assert [c.seq for c in sched.schedule(1)] == [other] and list(sched.waiting) == [mine]
    sched.end(mine)
    assert list(sched.waiting) == [] and not reads.ready(1)  # its payloads are not kept
    reads.close()
    chain.close()


class CountingHost(HostTier):
    def __init__(self, capacity):
        super().__init__(capacity)
        self.gets = 0

    def get(self, name):
        self.gets += 1
        return super().get(name)


def test_a_read_the_pool_had_no_room_for_is_kept_not_read_again():
    """The read finished but the pool cannot hold the prompt yet (another holds its blocks): the
    prompt waits with the payloads it read, and takes them once there is room, reading nothing
    twice."""
    tier = CountingHost(1 << 20)
    chain = TierChain([tier], NS)
    prompt = _stored(chain)
    reads = Reads(chain, Group.single(), "cpu")
    hooks = Hooks(reads)
    sched = Scheduler(BlockPool(5, BS), max_num_seqs=4, max_num_batched_tokens=64, prefix_caching=True, tiers=hooks)
    big = _seq(0, list(range(100, 113)))  # 13 tokens: 4 of the 5 blocks
    sched.add(big)
    assert [c.seq for c in sched.schedule(0)] == [big]
    mine = _seq(1, prompt)
    sched.add(mine)
    assert all(c.seq is big for c in sched.schedule(1))
    for step in range(2, 200):
        reads.idle()
        reads.poll()
        if reads.ready(1):
            break
    read = tier.gets
    assert read == 3
    for step in range(step, step + 3):  # no room: it waits, and reads nothing again
        assert all(c.seq is big for c in sched.schedule(step))
        reads.poll()
    assert tier.gets == read and not reads.reading(1)
    sched.end(big)
    chunks = sched.schedule(step + 1)
    assert [(c.seq.request.index, c.start) for c in chunks] == [(1, 12)]
    assert [p for _, p in hooks.filled] == [bytes([i]) * 8 for i in range(3)] and tier.gets == read
    reads.close()
    chain.close()
