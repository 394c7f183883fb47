"""The living engine's rank loop under --elastic-ep (a DPnEPn engine with redundant experts): the
one rank loop (engine/rank/loop.py) over the driver's channel, as engine/worker.py runs it, until a
collective fails because a peer died. The survivors then regroup and rebuild their stages at
DP(n-1)EP(n-1) (engine/rank/shrink.py) and serve on over the same channel.

Rank 0 keeps, beside the loop, every request the driver added and the tokens it has sent for
each (its `Feed` and `Outbox`): exactly what the driver has seen. After a loss it adds every
request that had not ended again, with those tokens as Request.generated (the migration's own
field), spread over the new replicas, so each goes on from the last token its client saw; a
request the driver sends meanwhile waits in the channel. It then tells the driver
("elastic", {lost, cause, layout, replicas, placed: {request: replica}, noticed_s, rebuilt_s,
stalled_s, ...}). An expert left without a source ends the engine: rank 0 first sends
("elastic_failed", its line), so the driver ends every request with that line.

Rank 0 serves the elastic store and is the link to the driver: its loss ends the engine.
"""

from __future__ import annotations

import dataclasses
import time

from atoll.engine.batch.request import Request
from atoll.engine.rank.job import EngineJob
from atoll.engine.rank.loop import Channel, ServeLoop
from atoll.engine.rank.shrink import ElasticRank, first_line
from atoll.errors import AtollError


class Feed:
    """Rank 0's feed: the driver's channel, each request it added kept (with its replica) until
    it ends; after a loss the unfinished ones come first, with their tokens so far."""

    def __init__(self, inbox, dp: int):
        self.channel, self.dp = Channel(inbox), dp
        self.live: dict[int, Request] = {}
        self.tokens: dict[int, list[int]] = {}  # request -> tokens sent to the driver since it was added
        self.resume: list = []

    def take(self, tick: int, busy: bool) -> list:
        out = self.resume + self.channel.take(tick, busy or bool(self.resume))
        self.resume = []
        for k, cmd in enumerate(out):
            if cmd[0] == "add":
                req, replica = cmd[1], cmd[2]
                if replica >= self.dp:  # sent before the driver heard of the loss
                    out[k] = ("add", req, replica % self.dp)
                self.live[req.index] = req
        return out

    def sent(self, msg) -> None:
        """A "step" on its way to the driver: its tokens and the requests that ended."""
        for index, token, *_ in msg[1]:
            if index in self.live:
                self.tokens.setdefault(index, []).append(token)
        for index, _ in msg[2]:
            self.live.pop(index, None)
            self.tokens.pop(index, None)

    def requeue(self, dp: int) -> dict[int, int]:
        """Every request not ended, added again at the next take with its tokens, the fewest
        on each of the `dp` new replicas; {request: replica}."""
        self.dp, load, placed = dp, [0] * dp, {}
        for index in sorted(self.live):
            req = self.live[index]
            replica = load.index(min(load))
            load[replica] += 1
            placed[index] = replica
            # a copy (n > 1) computes its prompt again: the request it forked from may be gone
            tokens = list(req.generated) + self.tokens.pop(index, [])
            self.resume.append(("add", dataclasses.replace(req, generated=tokens, arrival_step=0, fork_of=None), replica))
        self.live.clear()  # kept again as they are taken
        return placed


class Outbox:
    """Rank 0's outbox: the driver's channel, each step recorded in the Feed; a rebuilt stage's
    "ready" is not sent again (the driver hears "elastic")."""

    def __init__(self, outbox, feed: Feed):
        self.outbox, self.feed = outbox, feed
        self.started, self.last = False, time.monotonic()

    def put(self, msg) -> None:
        if msg[0] == "ready":
            if self.started:
                return
            self.started = True
        elif msg[0] == "step":
            self.feed.sent(msg)
            self.last = time.monotonic()
        self.outbox.put(msg)


def serve_elastic(rank: int, world_size: int, job: EngineJob, inboxes, outbox, device: str, node, ranks_here) -> None:
    """This rank of a living colocated engine, going on without a lost rank but rank 0."""
    spec = job.specs[0]
    me = ElasticRank(spec, rank, world_size, spec.engine.collective_timeout_s, device, node, job.options, ranks_here)
    feed = Feed(inboxes[0], me.layout.dp) if rank == 0 else None
    box = Outbox(outbox, feed) if rank == 0 else None
    while True:
        loop = ServeLoop(me.runner, feed, box, link_stats=job.link_stats, cache_events=job.cache_events)
        try:
            loop.ready()
            loop.run()
            return
        except RuntimeError as e:  # a collective failed: a peer is gone
            failed_at = time.monotonic()
            if len(me.ranks) == 1:
                raise
            cause = first_line(e)
        del loop
        try:
            rec = me.shrink(cause, failed_at)
        except AtollError as e:  # an expert without a source: the driver hears the line before the rank ends
            if box is not None:
                outbox.put(("elastic_failed", str(e)))
            raise
        if rec is None:
            return  # not among the survivors
        if box is not None:
            placed = feed.requeue(me.layout.dp)
            outbox.put(("elastic", rec | {"replicas": me.layout.dp, "placed": placed,
                                          "stalled_s": failed_at - box.last}))
