"""The one rank entry point: every launcher starts `worker` on every rank of every job, whether
a living engine (`atoll serve`, LLM.start), a one-shot job (start, submit everything, drain,
close) or a disaggregated one. A rank's role, colocated, prefill or decode, is its engine's in
the EngineJob (engine.rank.job); each builds its stage once and runs the one rank loop
(engine.rank.loop), prefill and decode ranks with the hand-off's hooks (engine.disagg.roles).
"""

from __future__ import annotations

import torch.distributed as dist

from atoll.comm.group import Group
from atoll.engine.disagg.roles import EngineRoles
from atoll.engine.rank.elastic_serve import serve_elastic
from atoll.engine.rank.job import EngineJob
from atoll.engine.rank.loop import Batch, ServeLoop
from atoll.engine.rank.runner import ModelRunner
from atoll.engine.rank.trace import StepTrace
from atoll.kernels import backend
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ParallelContext
from atoll.parallel.parts import bases, create_part


def worker(rank: int, world_size: int, job: EngineJob, inboxes=None, outbox=None, *, requests=None,
           device: str = "cpu", node: str | None = None, ranks_here: int | None = None):
    """Build this rank's stage of its engine and run its loop until told to stop.

    Living: `inboxes` holds one channel per engine (the driver's commands to its rank 0),
    `outbox` the channel rank 0 answers on (None on ranks that never talk to the driver, as
    under torchrun), or one channel per engine of a disaggregated job (its ranks answer on
    their engine's). One-shot (colocated only): `requests` instead, every rank the same list;
    they go to the DP replicas in turn, and rank 0 returns their results in order (with
    job.link_stats, (results, bytes by link class over every rank)); the other ranks None.
    `device`, `node` and `ranks_here` come from the launcher (launch.device.call_rank). The
    job's kernel path (its config's `kernels`) holds for this call only (kernels.backend.using)."""
    with backend.using(job.kernels):
        if requests is not None:
            return _one_shot(rank, world_size, job, requests, device, node, ranks_here)
        if job.roles == ("colocated",) and job.specs[0].engine.elastic_ep:  # goes on without a lost rank
            return serve_elastic(rank, world_size, job, inboxes, outbox, device, node, ranks_here)  # outbox: one a rank
        engine, loop = _build(rank, world_size, job, inboxes, outbox, device, node, ranks_here)
        loop.ready()
        loop.run()
        if loop.first and job.roles[engine] != "colocated":
            loop.outbox.put(("stopped", engine))


def _build(rank, world_size, job: EngineJob, inboxes, outbox, device, node, ranks_here) -> tuple[int, ServeLoop]:
    """(this rank's engine, its loop over its stage)."""
    if job.roles == ("colocated",):
        layout = job.layouts[0]
        ctx = ParallelContext.create(layout, rank, device, job.options, node=node) if world_size > 1 \
            else ParallelContext.single(device, job.options)
        runner = ModelRunner(job.specs[0], ctx, ranks_here=ranks_here)
        inbox = inboxes[0] if inboxes else None
        return 0, ServeLoop(runner, inbox, outbox, link_stats=job.link_stats, cache_events=job.cache_events)
    layouts = job.layouts
    engine, ctx = create_part(layouts, rank, device, job.options)
    world = Group(dist.group.WORLD, range(world_size), rank, "job", device)
    runner = ModelRunner(job.specs[engine], ctx, ranks_here=ranks_here)
    if isinstance(outbox, (list, tuple)):  # one channel per engine (engine/driver/channels.py says why)
        outbox = outbox[engine]
    # its role's hooks, swapped when the driver changes its role (engine.disagg.roles)
    loop = EngineRoles(runner, world, inboxes[engine], outbox, engine, layouts, bases(layouts), job.roles[engine]).loop
    loop.name = job.name(engine)
    if isinstance(loop.core.trace, StepTrace):
        loop.core.trace.engine = loop.name
    return engine, loop


def _one_shot(rank, world_size, job: EngineJob, requests, device, node, ranks_here):
    if job.roles != ("colocated",):
        raise ValueError("a one-shot job runs one colocated engine; a disaggregated one is a living job")
    dp = Layout.parse(job.specs[0].layout).dp
    batch = Batch(requests, lambda k: k % dp)
    _, loop = _build(rank, world_size, job, None, None, device, node, ranks_here)
    loop.feed, loop.outbox = batch, _Sink(batch)
    loop.ready()
    loop.run()
    if rank != 0:
        return None
    ordered = [batch.results[r.index] for r in requests]
    return (ordered, loop.outbox.links) if job.link_stats else ordered


class _Sink:
    """Rank 0's outbox in a one-shot job: steps go to the Batch, the link totals are kept."""

    def __init__(self, batch: Batch):
        self.batch, self.links = batch, None

    def put(self, msg) -> None:
        if msg[0] == "links":
            self.links = msg[1]
        else:
            self.batch.put(msg)
