"""The living engine's rank loop: every rank builds its stage once, then loops until told to
stop. Each pass, the engine's rank 0 takes what the driver sent since the last one (requests
to add, ids to abort, stop) and broadcasts it over the engine's ranks, so every rank adds and
aborts the same requests at the same tick; every rank runs one tick of its EngineCore; rank 0
sends the driver the tokens each request took, the requests that ended and the engine's
counters. With DP each replica's leader knows only its own replica's tokens: they are
gathered on rank 0 every pass.

When nothing runs anywhere, rank 0 waits for the driver up to IDLE_S before broadcasting, so
an idle engine costs one small collective per IDLE_S (well inside the collective timeout).

Messages. Driver -> rank 0 (inbox): ("add", Request, replica), ("abort", index), ("stop",).
Rank 0 -> driver (outbox): ("ready", info) once the ranks are built, then ("step", tokens,
finished, stats, engine) whenever a pass produced something or the counters changed: tokens
[(index, token)], finished [(index, result)], stats {running, waiting, blocks_in_use,
num_blocks, ...}, engine the loop's name (None for a plain engine).

`ServeLoop` is that loop for one engine; a disaggregated job (engine/disagg/live.py) runs
one per engine, each over its own ranks, with hooks for the hand-off between them.
"""

from __future__ import annotations

import queue

import torch.distributed as dist

from atoll.engine.rank.core import EngineCore
from atoll.engine.rank.run_spec import RunSpec
from atoll.engine.rank.runner import ModelRunner
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ContextOptions, ParallelContext

IDLE_S = 0.5


def serve_worker(rank: int, world_size: int, spec: RunSpec, inbox, outbox, parallel: ContextOptions | None = None,
                 device: str = "cpu", node: str | None = None, ranks_here: int | None = None) -> None:
    layout = Layout.parse(spec.layout)
    ctx = ParallelContext.create(layout, rank, device, parallel, node=node) if world_size > 1 \
        else ParallelContext.single(device, parallel)
    loop = ServeLoop(ModelRunner(spec, ctx, ranks_here=ranks_here), inbox, outbox)
    loop.ready()
    loop.run()


class ServeLoop:
    """One engine's ranks serving until told to stop. Hooks, for a disaggregated job:
    `on_token(seq, started)` as a sequence takes a token (EngineCore's), `inbox` an
    EngineCore inbox (sequences whose prompt arrived computed), `command(cmd)` for messages
    other than add/abort/stop, `forward(index, result)` whether a finished request is
    reported to the driver (default: all)."""

    def __init__(self, runner, inbox, outbox, *, on_token=None, inbox_hook=None, command=None, forward=None,
                 name: str | None = None, cache_events: bool = False):
        self.runner, self.ctx, self.name = runner, runner.ctx, name
        self.inbox, self.outbox = inbox, outbox
        self.finished: list = []
        self.core = EngineCore(runner, on_finish=lambda index, result: self.finished.append((index, result)),
                               on_token=on_token, inbox=inbox_hook)
        self.command, self.forward = command, forward
        self.leader = self.ctx.coords.tp == 0 and self.ctx.is_first_stage  # holds its replica's tokens
        self.group = self.ctx.world  # this engine's ranks
        self.first = self.group.rank == 0  # talks to the driver
        # cache_events: each step's stats carry "kv_events", [(replica, named?, block name)], the
        # prefix blocks this engine's pools named or evicted (the driver's routing reads them)
        self.cache_events = cache_events
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
                                       "max_num_seqs": spec.engine.max_num_seqs, "engine": self.name}))

    def run(self) -> None:
        core, last = self.core, None
        self.runner.start_run()
        while True:
            commands = _take(self.inbox, wait=not core.busy) if self.first else None
            commands = self._broadcast(commands)
            if self._apply(commands):
                break
            core.step()
            finished = [(i, r) for i, r in self.finished if self.forward is None or self.forward(i, r)]
            self.finished.clear()
            mine = (core.drain(), finished, self._stats()) if self.leader else ([], [], None)
            parts = self._gather(mine)
            if self.first:
                tokens = [t for p in parts for t in p[0]]
                done = [f for p in parts for f in p[1]]
                stats = _sum([p[2] for p in parts if p[2] is not None])
                if tokens or done or stats != last:
                    self.outbox.put(("step", tokens, done, stats, self.name))
                    last = stats
        self.runner.end_run()

    def _stats(self) -> dict:
        """This replica's counters, and its cache events since the last step when asked for."""
        stats = _stats(self.core)
        if self.cache_events:
            replica, events = self.ctx.coords.dp, []
            for lane in self.core.lanes.schedulers:
                events += [(replica, named, name) for named, name in lane.pool.events]
                lane.pool.events.clear()
            stats["kv_events"] = events
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


def _take(inbox, *, wait: bool) -> list:
    """Every message waiting in the inbox; when `wait`, block up to IDLE_S for the first."""
    out = []
    try:
        out.append(inbox.get(timeout=IDLE_S) if wait else inbox.get_nowait())
        while True:
            out.append(inbox.get_nowait())
    except queue.Empty:
        pass
    return out


def _stats(core: EngineCore) -> dict:
    lanes = core.lanes.schedulers
    return {"running": sum(len(s.running) for s in lanes), "waiting": sum(len(s.waiting) for s in lanes),
            "blocks_in_use": core.blocks_in_use(), "blocks_cached": core.cached_blocks(),
            "num_blocks": sum(s.pool.num_blocks for s in lanes)} | core.window_stats()


def _sum(parts: list[dict]) -> dict | None:
    """The replicas' counters added up (lists, such as cache events, joined)."""
    if not parts:
        return None
    return {k: sum((p[k] for p in parts), [] if isinstance(parts[0][k], list) else 0) for k in parts[0]}
