"""The rank loop, the only one: every rank of an engine builds its stage once (engine/worker.py),
then loops until told to stop. Each pass, the engine's rank 0 takes what its feed holds (requests
to add, ids to abort, stop) and broadcasts it over the engine's ranks, so every rank adds and
aborts the same requests at the same tick; every rank runs one tick of its EngineCore; rank 0
sends its outbox the tokens each request took, the requests that ended and the engine's
counters. With DP each replica's leader knows only its own replica's tokens: they are
gathered on rank 0 every pass.

Two feeds. A living engine's is the driver's channel (`Channel`): when nothing runs anywhere,
rank 0 waits for the driver up to IDLE_S before broadcasting, so an idle engine costs one
small collective per IDLE_S (well inside the collective timeout). A one-shot job's is `Batch`:
a fixed list of requests, each joining at its arrival_step, then stop once every one has ended
(start, submit everything, drain, close: the living loop, fed all at once).

Messages. Feed -> rank 0: ("add", Request, replica), ("adds", [add, ...]) (several that join
at one tick), ("abort", index), ("tick",) (run a tick though nothing is running: a later
arrival is due), ("stop",). Rank 0 -> outbox: ("ready",
info) once the ranks are built, then ("step", tokens, finished, stats, engine) whenever a pass
produced something or the counters changed: tokens [(index, token)], finished [(index,
result)], stats {running, waiting, blocks_in_use, num_blocks, ...}, engine the loop's name
(None for a plain engine); with `link_stats`, ("links", bytes by link class summed over the
engine's ranks) as it stops.

`ServeLoop` is that loop for one engine; a disaggregated job (engine/disagg/roles.py) runs
one per engine, each over its own ranks, with hooks for the hand-off between them.
"""

from __future__ import annotations

import queue
from collections import deque

import torch.distributed as dist

from atoll.engine.batch.request import Request
from atoll.engine.rank.core import EngineCore
from atoll.engine.rank.faults import RankFaults
from atoll.engine.rank.trace import StepTrace
from atoll.parallel import links

IDLE_S = 0.5


class Channel:
    """A living engine's feed: the driver's channel (a queue), read on rank 0."""

    def __init__(self, inbox):
        self.inbox = inbox

    def take(self, tick: int, busy: bool) -> list:
        """Every message waiting; when idle, wait up to IDLE_S for the first."""
        out = []
        try:
            out.append(self.inbox.get(timeout=IDLE_S) if not busy else self.inbox.get_nowait())
            while True:
                out.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        return [c for msg in out for c in (msg[1] if msg[0] == "adds" else [msg])]


class Batch:
    """A one-shot job's feed and outbox on rank 0: `requests`, each added at its arrival_step to
    replica `replica(k)` (k its position), then ("stop",) once every one has ended. `results`
    holds them by request index; on_finish(index, result) is called as each ends."""

    def __init__(self, requests: list[Request], replica=lambda k: 0, on_finish=None):
        order = sorted(range(len(requests)), key=lambda k: (requests[k].arrival_step, requests[k].index))
        placed = {requests[k].index: replica(k) for k in order}
        # a copy (n > 1) joins its first copy's replica, to fork from it there
        self.waiting = deque((requests[k], placed.get(requests[k].fork_of, placed[requests[k].index]))
                             for k in order)
        self.open = len(requests)
        self.results: dict[int, dict] = {}
        self.on_finish = on_finish

    def take(self, tick: int, busy: bool) -> list:
        if not self.open:
            return [("stop",)]
        out = []
        while self.waiting and self.waiting[0][0].arrival_step <= tick:
            req, replica = self.waiting.popleft()
            out.append(("add", req, replica))
        if self.waiting:
            out.append(("tick",))  # a later arrival: the clock runs on while nothing else does
        return out

    def put(self, msg) -> None:
        if msg[0] != "step":
            return
        for index, result in msg[2]:
            self.results[index] = result
            self.open -= 1
            if self.on_finish is not None:
                self.on_finish(index, result)


def run_batch(runner, requests: list[Request], *, pipelined: bool = True, trace: list | None = None) -> list:
    """`requests` through an already built runner's rank loop until all have ended, every rank
    given the same list (in lock step). One replica: one result per request, in order, on
    every rank. With DP the requests go to the replicas in turn: the engine's rank 0 returns
    every result in order, the other ranks their own replica's (None for the others). For
    tools that time or inspect a stage in place (bench, calibrate, tests); jobs start
    engine/worker.py. trace: each tick's shape and seconds (EngineCore's)."""
    dp = runner.ctx.layout.dp
    feed = Batch(requests, (lambda k: k % dp) if dp > 1 else (lambda k: runner.ctx.coords.dp))
    loop = ServeLoop(runner, feed, feed, pipelined=pipelined, trace=trace)
    loop.run()
    if dp > 1 and loop.first:
        return [feed.results[r.index] for r in requests]
    return [loop.core.results.get(r.index) for r in requests]


class ServeLoop:
    """One engine's ranks serving until told to stop. Hooks, for a disaggregated job:
    `on_token(seq, started)` as a sequence takes a token (EngineCore's), `inbox` an
    EngineCore inbox (sequences whose prompt arrived computed), `command(cmd)` for messages
    other than add/abort/stop, `forward(index, result)` whether a finished request is
    reported to the driver (default: all)."""

    def __init__(self, runner, inbox, outbox, *, on_token=None, inbox_hook=None, command=None, forward=None,
                 name: str | None = None, cache_events: bool = False, pipelined: bool = True,
                 link_stats: bool = False, trace: list | None = None):
        self.runner, self.ctx, self.name = runner, runner.ctx, name
        # the feed: a Batch, or the driver's channel (None on ranks but 0, which never read it)
        self.feed = inbox if inbox is None or hasattr(inbox, "take") else Channel(inbox)
        self.outbox = outbox
        self.finished: list = []
        path = runner.spec.engine.step_trace
        if trace is None and path and runner.ctx.world.rank == 0:
            trace = StepTrace(path, name)
        self.core = EngineCore(runner, on_finish=lambda index, result: self.finished.append((index, result)),
                               on_token=on_token, inbox=inbox_hook, pipelined=pipelined, trace=trace)
        self.link_stats = link_stats  # count the run's bytes by link class (parallel.links), sent as it stops
        self.command, self.forward = command, forward
        self.leader = self.ctx.coords.tp == 0 and self.ctx.is_first_stage  # holds its replica's tokens
        self.group = self.ctx.world  # this engine's ranks
        self.first = self.group.rank == 0  # talks to the driver
        self.faults = RankFaults(runner.spec.engine.fault_injection, self.group.rank)  # config.faults: off by default
        # cache_events: each step's stats carry "kv_events", [(replica, named?, block name)], the
        # prefix blocks this engine's pools named or evicted (the driver's routing reads them)
        self.cache_events = cache_events
        self.events_published = 0  # this replica's, since start (summed over replicas by the driver)
        if cache_events:
            for lane in self.core.lanes.schedulers:
                lane.pool.events = []

    def ready(self) -> None:
        """Compile (or capture) the decode step now, then tell the driver the ranks are ready."""
        if self.runner.decode_step is not None:
            self.runner.decode_step.warm_up()
        if self.first:
            spec, layout = self.runner.spec, self.ctx.layout
            self.outbox.put(("ready", {"num_blocks": self.runner.num_blocks, "block_size": spec.engine.block_size,
                                       "max_model_len": spec.max_model_len, "replicas": layout.dp,
                                       "max_num_seqs": spec.engine.max_num_seqs, "engine": self.name,
                                       "kv_tiers": self.runner.kv_tiers is not None}))

    def run(self) -> None:
        core, last = self.core, None
        if self.link_stats:
            links.reset(self.ctx, self.runner.model)  # the run's own traffic, not the warm-up's
        self.runner.start_run()
        if self.faults:
            self.faults.after_step(ran=False)
        while True:
            commands = self.feed.take(core.tick, core.busy) if self.first else None
            commands = self._broadcast(commands)
            if self._apply(commands):
                break
            ran = core.step(more=any(c[0] == "tick" for c in commands))
            if ran and self.faults:
                self.faults.after_step()
            if ran and self.runner.balancer is not None:  # between two steps: the expert load window, rebalances
                self.runner.balancer.after_step()
            finished = [(i, r) for i, r in self.finished if self.forward is None or self.forward(i, r)]
            self.finished.clear()
            mine = (core.drain(), finished, self._stats()) if self.leader else ([], [], None)
            parts = self._gather(mine)
            if self.first:
                tokens = [t for p in parts for t in p[0]]
                done = [f for p in parts for f in p[1]]
                stats = _sum([p[2] for p in parts if p[2] is not None])
                if stats is not None and self.runner.balancer is not None and self.runner.balancer.report:
                    stats["expert_load"] = self.runner.balancer.report  # MoE: max/mean tokens per EP rank
                if tokens or done or stats != last:
                    self.outbox.put(("step", tokens, done, stats, self.name))
                    last = stats
        self.runner.end_run()
        if self.runner.balancer is not None:  # the expert weights in flight land (the placement stays)
            self.runner.balancer.close()
        if self.runner.kv_tiers is not None:  # the queued writes land (a restart finds them)
            self.runner.kv_tiers.close()
        # every block is back once every request ended; named ones stay cached (evictable)
        self.runner.stats |= {"blocks_held": core.blocks_in_use(), "blocks_cached": core.cached_blocks()}
        if self.link_stats:
            self._send_links()

    def _send_links(self) -> None:
        """Every rank's bytes by link class, summed on rank 0 and sent to the outbox."""
        counted = links.rank_bytes(self.ctx, self.runner.model, compiled=self.runner.decode_step is not None)
        # MoE: the run's expert load by EP rank, beside the bytes (every rank measures: collectives)
        load = self.runner.balancer.measure() if self.runner.balancer is not None else None
        g = self.group
        parts = [counted]
        if g.size > 1:
            parts = [None] * g.size if self.first else None
            dist.gather_object(counted, parts, dst=g.ranks[0], group=g.pg)
        if self.first:
            totals = links.total(parts)
            if load is not None:
                totals["expert_load"] = load
            self.outbox.put(("links", totals))

    def _stats(self) -> dict:
        """This replica's counters, and its cache events since the last step when asked for."""
        stats = _stats(self.core)
        if self.cache_events:
            replica, events = self.ctx.coords.dp, []
            for lane in self.core.lanes.schedulers:
                events += [(replica, named, name) for named, name in lane.pool.events]
                lane.pool.events.clear()
            stats["kv_events"] = events
            self.events_published += len(events)
            stats["kv_events_published"] = self.events_published
        return stats

    def _apply(self, commands: list) -> bool:
        """Add and abort as the driver asked; True when it asked to stop."""
        replica = self.ctx.coords.dp
        for cmd in commands:
            if cmd[0] == "add":
                if cmd[2] == replica:
                    self.core.add(cmd[1])
            elif cmd[0] == "abort":
                self.core.abort(cmd[1])
                if self.command is not None:
                    self.command(cmd)
            elif cmd[0] == "stop":
                return True
            elif cmd[0] == "tick":
                pass
            elif self.command is not None:
                self.command(cmd)
        return False

    def _broadcast(self, commands):
        g = self.group
        if g.size == 1:
            return commands
        box = [commands]
        dist.broadcast_object_list(box, src=g.ranks[0], group=g.pg)
        return box[0]

    def _gather(self, mine) -> list:
        """Every replica leader's (tokens, finished, stats) on rank 0; with one replica rank 0
        is its leader and nothing moves."""
        g = self.group
        if self.ctx.layout.dp == 1:
            return [mine] if self.first else []
        parts = [None] * g.size if self.first else None
        dist.gather_object(mine, parts, dst=g.ranks[0], group=g.pg)
        return parts if self.first else []


def _stats(core: EngineCore) -> dict:
    lanes = core.lanes.schedulers
    tiers = core.runner.kv_tiers
    return ({"running": sum(len(s.running) for s in lanes), "waiting": sum(len(s.waiting) for s in lanes),
             "blocks_in_use": core.blocks_in_use(), "blocks_cached": core.cached_blocks(),
             "num_blocks": sum(s.pool.num_blocks for s in lanes)} | core.window_stats()
            | (tiers.stats() if tiers is not None else {}))


def _sum(parts: list[dict]) -> dict | None:
    """The replicas' counters added up (lists, such as cache events, joined)."""
    if not parts:
        return None
    return {k: sum((p[k] for p in parts), [] if isinstance(parts[0][k], list) else 0) for k in parts[0]}
