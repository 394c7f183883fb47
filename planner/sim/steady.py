"""Steady decode, fast-forwarded: the ticks a simulated engine would spend with the same
sequences each taking one token, taken as one event.

When a tick's micro-batch is nothing but decode rows, one for every running sequence of every
DP replica, with no prompt waiting that could join, no draft, no hand-over pending and no
sequence about to finish, the scheduler would schedule that same batch again every tick until a
request arrives or a sequence ends: only the context grows. Such a run of ticks is planned at
once (`plan`): each tick's time from the cost model as before, the blocks and their names taken
tick by tick as the scheduler takes them (the same BlockPool calls, in the same order), the
tokens and their timestamps as the ticks would give them. A request that arrives mid-run cuts
it at the tick then under way (`Run.cut`), so it joins at the next tick exactly as it would.
The figures are the same as ticking one by one (tests/planner/test_sim_steady.py), only fewer
Python steps: a decode token costs an append instead of a scheduler pass.

Not fast-forwarded: pipelines (their lanes interleave), speculation, sliding windows, context-
parallel pools, a disaggregated decode engine with prefix caching (its pools' cache events
feed the driver's choice between ticks), and ticks while the KV tiers read a prompt's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from atoll.engine.batch.scheduler import Scheduled
from atoll.engine.batch.shape import padded_keys
from atoll.engine.kv.blocks import BlockPool

MAX_TICKS = 4096  # one run at most (its tick times are listed)


@dataclass
class Run:
    """Ticks 1 .. len(ends) - 1 after the micro-batch scheduled at tick 0, which ends at ends[0]."""
    rows: list  # [(scheduler, seq)] in the order the scheduler takes them
    ends: list[float]  # when each tick ends
    costs: list[tuple[float, tuple]] = field(default_factory=list)  # ticks 1..: (seconds, cost key)

    @property
    def ticks(self) -> int:
        return len(self.ends)

    def cut(self, now: float) -> float | None:
        """A request arrives at `now`: keep the ticks begun before it (at least the first); the
        seconds dropped, or None when nothing is."""
        starts_before = sum(1 for e in self.ends[:-1] if e < now)  # ticks 1.. begin at ends[0..]
        keep = max(1, 1 + starts_before)
        if keep >= len(self.ends):
            return None
        dropped = sum(s for s, _ in self.costs[keep - 1:])
        del self.ends[keep:], self.costs[keep - 1:]
        return dropped

    def running_tick(self, now: float) -> int:
        """Ticks since tick 0 of the tick under way at `now`."""
        return min(len(self.ends) - 1, sum(1 for e in self.ends[:-1] if e < now))


def plan(engine, chunks: list[list], start: float, first_s: float) -> Run | None:
    """The run of steady ticks after tick 0 (its chunks per DP replica, begun at `start`,
    lasting first_s), or None when tick 0 is not steady or the run would be one tick."""
    if engine.depth != 1 or engine.drafter is not None or engine.adopting or not engine.fast:
        return None
    for replica, part in zip(engine.replicas, chunks):  # the cheap tests first: most ticks fail one
        (sched,) = replica.schedulers
        if (len(part) != len(sched.running) or (sched.waiting and len(sched.running) < sched.max_num_seqs)
                or sched.loading):  # a prompt whose blocks the KV tiers are reading joins when they end
            return None
        pool = sched.pool
        if (type(pool) is not BlockPool or pool.stripes != 1 or sched.window is not None
                or (pool.events is not None and sched.prefix_caching)):
            return None
    rows, limit, per_replica, max_len = [], MAX_TICKS, [], engine.max_model_len
    for replica, part in zip(engine.replicas, chunks):
        sched = replica.schedulers[0]
        ctx = longest = 0
        for c in part:
            seq = c.seq
            p = seq.request.params
            prompt, out = len(seq.request.prompt_token_ids), len(seq.output)
            # a decode row (its last token), no stop tokens, and not ending within the run
            if c.count != 1 or c.start != prompt + out - 1 or c.start < prompt or p.stop_token_ids or p.stop:
                return None
            limit = min(limit, p.max_tokens - out - 1, max_len - prompt - out - 1)
            if limit < 2:
                return None
            ctx += c.start + 1
            longest = max(longest, c.start + 1)
            rows.append((sched, seq))
        per_replica.append((len(part), ctx, longest))
    ticks = limit
    while ticks >= 2 and not _blocks_fit(engine, rows, ticks):
        ticks //= 2
    if ticks < 2:
        return None
    run = Run(rows, [start + first_s])
    multi = len(per_replica) > 1
    total_rows = sum(n for n, _, _ in per_replica)
    top_rows = max(n for n, _, _ in per_replica)
    ctx0 = sum(c for _, c, _ in per_replica)
    t = run.ends[0]
    size, cap, buckets = engine.block_size, engine.max_blocks, engine.buckets
    for j in range(1, ticks):
        # the keys a compiled step reads: each replica's rows up to its longest row, padded
        padded = sum(padded_keys(n, top + j, size, cap, buckets) for n, _, top in per_replica)
        pass_s, _, key = engine.cost.tick(total_rows, 0, ctx0 + j * total_rows, 0.0,
                                          dp_rows=top_rows if multi else None, dp_chunk_tokens=0 if multi else None,
                                          ctx_padded=padded, split=engine.eager_decode and engine.splits(chunks, j))
        t = t + pass_s
        run.ends.append(t)
        run.costs.append((pass_s, key))
    return run


def _blocks_fit(engine, rows, ticks: int) -> bool:
    """Whether every row can grow `ticks` - 1 positions past tick 0's without a preemption."""
    need: dict[int, int] = {}
    for sched, seq in rows:
        pool = sched.pool
        more = pool.blocks_for(seq.cached + ticks) - len(seq.blocks)
        if more > 0:
            need[id(pool)] = need.get(id(pool), 0) + more
    pools = {id(s.pool): s.pool for s, _ in rows}
    return all(n <= pools[k].num_free for k, n in need.items())


def settle(engine, run: Run, apply_first) -> None:
    """The run's ticks happen: tick 0's chunks through apply_first(t), then each later tick's
    blocks (the scheduler's grow and names), token and timestamp, in the scheduler's order."""
    apply_first(run.ends[0])
    # the pool and the scheduler are called only where a tick changes something, in the same
    # order as ticking one by one: a row entering a new block grows its table, one filling a
    # block names it (with prefix caching); the other calls return at once, so they are skipped
    rows = [(sched, seq, sched.pool, sched.pool.block_size, sched.prefix_caching) for sched, seq in run.rows]
    take, count = engine.take, engine.cost.count
    for (seconds, key), begun, t in zip(run.costs, run.ends, run.ends[1:]):
        count(key)
        engine.now = begun  # the KV tiers' clock for the blocks the tick names, as at its start
        for sched, seq, pool, size, naming in rows:
            n = seq.cached + 1
            if n > len(seq.blocks) * size:
                pool.grow(seq.blocks, n)
            if naming and n // size > seq.named:
                sched.commit(Scheduled(seq, seq.cached, 1))
            seq.cached = n
            take(seq, t)
