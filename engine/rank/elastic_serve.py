"""The living engine's rank loop under --elastic-ep (a DPnEPn engine with redundant experts): the
one rank loop (engine/rank/loop.py) over the driver's channels, as engine/worker.py runs it, until a
collective fails because a peer died. The survivors then regroup and rebuild their stages at
DP(n-1)EP(n-1) (engine/rank/shrink.py) and serve on.

The driver serves the elastic store and names the survivors (engine/driver/elastic.py), so any
rank may be lost, rank 0 included. Every rank is given a channel pair of its own (inboxes[rank],
outboxes[rank]): the round's rank 0, the leader, talks to the driver over its job rank's pair, so
a new leader never reads a queue a killed one may have held locked.

After a loss the new leader tells the driver ("elastic", {lost, cause, layout, replicas,
noticed_s, rebuilt_s, stalled_s, ...}) and drops every add (holding aborts) until the driver's
("resume", [(request, replica), ...]): every request that had not ended, with the tokens the
driver had streamed as Request.generated (the migration's own field), so each goes on from the
last token its client saw. Anything the driver sent before its resume is in it; an add sent
after it for a request the resume already held is dropped. An expert left without a source
ends the engine: the leader to be first sends ("elastic_failed", its line), so the driver ends
every request with that line.
"""

from __future__ import annotations

import time

from atoll.engine.rank.job import EngineJob
from atoll.engine.rank.loop import Channel, ServeLoop
from atoll.engine.rank.shrink import ElasticRank, first_line
from atoll.errors import AtollError


class Feed:
    """The leader's feed: the driver's channel; `waiting` (after a loss): adds and aborts are
    dropped until the driver's resume. Requests not ended are kept, so no add runs twice."""

    def __init__(self, inbox, dp: int, waiting: bool = False):
        self.channel, self.dp, self.waiting = Channel(inbox), dp, waiting
        self.live: set[int] = set()
        self.aborts: list = []  # aborts that came while waiting: applied after the resume's adds

    def take(self, tick: int, busy: bool) -> list:
        out = []
        for cmd in self.channel.take(tick, busy):
            if cmd[0] == "resume":
                self.waiting = False
                cmds = [("add", req, replica) for req, replica in cmd[1]] + self.aborts
                self.aborts = []
            elif self.waiting and cmd[0] == "add":
                continue  # the resume carries it
            elif self.waiting and cmd[0] == "abort":
                self.aborts.append(cmd)
                continue
            else:
                cmds = [cmd]
            for c in cmds:
                if c[0] == "add":
                    if c[1].index in self.live:
                        continue
                    self.live.add(c[1].index)
                    c = ("add", c[1], c[2] % self.dp)  # a replica chosen before the driver heard of a loss
                out.append(c)
        return out


class Outbox:
    """The leader's outbox: the driver's channel; the requests that end leave the Feed's live set.
    A rebuilt stage's "ready" is not sent (the driver hears "elastic")."""

    def __init__(self, outbox, feed: Feed, started: bool = False):
        self.outbox, self.feed = outbox, feed
        self.started, self.last = started, time.monotonic()

    def put(self, msg) -> None:
        if msg[0] == "ready":
            if self.started:
                return
            self.started = True
        elif msg[0] == "step":
            self.feed.live.difference_update(index for index, _ in msg[2])
            self.last = time.monotonic()
        self.outbox.put(msg)


def serve_elastic(rank: int, world_size: int, job: EngineJob, inboxes, outboxes, device: str, node,
                  ranks_here) -> None:
    """This rank (job rank `rank`) of a living colocated engine that goes on without lost ranks."""
    spec = job.specs[0]
    me = ElasticRank(spec, rank, world_size, spec.engine.collective_timeout_s, device, node, job.options, ranks_here,
                     store=job.elastic_store)
    box, recovered = None, False
    while True:
        if me.me == 0:  # the leader: a fresh feed after a loss, waiting for the driver's resume
            feed = Feed(inboxes[rank], me.layout.dp, waiting=recovered)
            box = Outbox(outboxes[rank], feed, started=recovered)
        else:
            feed = box = None
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
        old = me.me
        try:
            rec = me.shrink(cause, failed_at)
        except AtollError as e:  # an expert without a source: the driver hears the line before the rank ends
            if me.keep and me.keep[0] == old:
                outboxes[rank].put(("elastic_failed", str(e)))
            raise
        if rec is None:
            return  # not among the survivors
        recovered = True
        if me.me == 0:
            # stalled_s: the last step report to the failure, when this rank led the round before
            stalled = failed_at - box.last if box is not None else None
            outboxes[rank].put(("elastic", rec | {"replicas": me.layout.dp, "stalled_s": stalled}))
