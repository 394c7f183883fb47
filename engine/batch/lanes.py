"""Lanes: how pipelined decode keeps every stage busy (a lane's micro-batch on the device is
engine.sample.micro_batch).

Under PP the requests are split between lanes, each a `Scheduler` with its own share of the
KV blocks. Tick t schedules lane t mod pp and feeds its micro-batch to the first stage,
while stage s works on the micro-batch that entered at tick t - s. With pp lanes a micro-
batch enters every tick, so every stage works every tick; with one lane (`pipelined=False`)
a micro-batch enters every pp-th tick and each stage idles pp - 1 ticks of every pp.
max_num_seqs bounds each micro-batch, as in vLLM: pp lanes keep up to pp x max_num_seqs
sequences running, each stage reading its weights once per tick for max_num_seqs of them.

A lane is scheduled again only after its last micro-batch has left the last stage and its
tokens are known, so a sequence is never scheduled, grown or preempted while in flight.
Every rank of a replica runs the same lanes on the same tokens, so all agree on every
micro-batch without communication.
"""

from __future__ import annotations

from atoll.engine.batch.scheduler import Scheduler, Sequence
from atoll.engine.kv.blocks import BlockPool
from atoll.engine.kv.windowed import WindowedPool


def lane_count(*, num_blocks: int, block_size: int, max_model_len: int, depth: int, pipelined: bool = True,
               cp: int = 1) -> int:
    """depth lanes when pipelined, but no more than the blocks allow while each lane still
    holds one max_model_len sequence (num_blocks per rank, a sequence striped over cp ranks);
    at least one."""
    per_seq = -(-(-(-max_model_len // block_size)) // cp)
    return max(1, min(depth if pipelined else 1, num_blocks // per_seq))


class Lanes:
    def __init__(self, *, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, depth: int, pipelined: bool = True, prefix_caching: bool = False,
                 drafter=None, sliding_window: int | None = None, cp: int = 1,
                 window_pool: tuple[int, int] | None = None, tiers=None):
        """depth: pipeline stages; as many lanes as `lane_count` gives. prefix_caching: each
        lane's pool keeps its own cache of named blocks (engine.kv.blocks). drafter: speculative
        tokens for every lane (engine.spec.registry), or None. sliding_window: blocks a running
        sequence's window has passed go back to its lane's pool (block num_blocks, the cache's
        scratch block, stands in for them). cp: context parallel ranks; num_blocks is per rank
        and each pool stripes a sequence's blocks over the cp ranks (engine.kv.blocks).
        window_pool: (width, blocks) when the sliding layers keep their own cache of `blocks`
        blocks (engine.kv.windowed; width their widest window); its block `blocks` is its hole.
        tiers: the KV cache's lower tiers, every lane's (Scheduler)."""
        count = lane_count(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
                           depth=depth, pipelined=pipelined, cp=cp)
        share = num_blocks // count
        self.depth = depth
        # the hole's global id reads as local block num_blocks (the scratch block) on every cp rank
        pools = [BlockPool(share, block_size, first=i * share, hole=num_blocks * cp, stripes=cp) for i in range(count)]
        if window_pool is not None:
            if cp != 1:
                raise ValueError("a sliding layers' pool is not striped over cp ranks")
            sliding_window, blocks = window_pool
            part = blocks // count
            pools = [WindowedPool(pool, BlockPool(part, block_size, first=i * part, hole=blocks), sliding_window)
                     for i, pool in enumerate(pools)]
        self.schedulers = [Scheduler(pool, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                     prefix_caching=prefix_caching, drafter=drafter, sliding_window=sliding_window,
                                     tiers=tiers)
                           for pool in pools]

    def __len__(self) -> int:
        return len(self.schedulers)

    def add(self, seq: Sequence) -> None:
        """To the lane with the fewest unfinished sequences (the first of those on a tie)."""
        loads = [len(s.waiting) + len(s.running) for s in self.schedulers]
        seq.lane = loads.index(min(loads))
        self.schedulers[seq.lane].add(seq)

    def adopt(self, seq: Sequence, step: int) -> bool:
        """A sequence whose prompt is already computed elsewhere, to the least loaded lane
        (Scheduler.adopt); False when that lane has no room yet."""
        loads = [len(s.waiting) + len(s.running) for s in self.schedulers]
        seq.lane = loads.index(min(loads))
        return self.schedulers[seq.lane].adopt(seq, step)

    def fork(self, parent: Sequence, child: Sequence, step: int) -> list[tuple[int, int]]:
        """A copy of parent's request into parent's lane (Scheduler.fork): the blocks to copy."""
        child.lane = parent.lane
        return self.schedulers[parent.lane].fork(parent, child, step)

    def at(self, tick: int) -> Scheduler | None:
        """The lane whose micro-batch enters the pipeline at this tick, if any."""
        slot = tick % self.depth
        return self.schedulers[slot] if slot < len(self.schedulers) else None

    def has_work(self) -> bool:
        return any(s.has_work() for s in self.schedulers)

    def finish(self, seq: Sequence) -> None:
        self.schedulers[seq.lane].finish(seq)

    def end(self, seq: Sequence) -> None:
        """The sequence leaves its lane, waiting or running (Scheduler.end)."""
        self.schedulers[seq.lane].end(seq)
