"""The one worker entry every launcher calls on every rank."""

from __future__ import annotations

import torch.distributed as dist

from atoll.engine.rank.generate import Request, run_requests
from atoll.engine.rank.run_spec import RunSpec
from atoll.engine.rank.runner import ModelRunner
from atoll.parallel import links
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ContextOptions, ParallelContext


def generate_worker(rank: int, world_size: int, spec: RunSpec, requests: list[Request], progress=None,
                    parallel: ContextOptions | None = None, stats: bool = False, device: str = "cpu",
                    node: str | None = None, ranks_here: int | None = None):
    """Build this rank's stage, run every request; rank 0 returns the results, others None.
    `parallel`: the ranks' islands and the MoE dispatch options (parallel.mesh.ContextOptions).
    `stats`: rank 0 returns (results, bytes by link class summed over every rank) instead:
    parallel.links counts the run's own traffic (the counters are zeroed before it).

    `progress`, if given, is the parent's channel (a multiprocessing queue from the local
    launcher, or any object with put(), such as cli.progress.Reports on rank 0 under
    torchrun/mpirun). Rank 0 puts ("step", requests done, tokens made) after each step, and
    each replica's first rank puts ("done", request index, result) as each of its requests
    finishes, so the parent can write it before the run ends. `device`, `node` and
    `ranks_here` come from the launcher (launch.device.call_rank)."""
    layout = Layout.parse(spec.layout)
    ctx = ParallelContext.create(layout, rank, device, parallel, node=node) if world_size > 1 \
        else ParallelContext.single(device, parallel)
    runner = ModelRunner(spec, ctx, ranks_here=ranks_here)
    mine = requests[ctx.coords.dp::layout.dp]  # each DP replica serves its own requests
    leader = ctx.coords.tp == 0 and ctx.is_first_stage  # the rank that holds its replica's results
    report = _scaled_reporter(progress, layout.dp) if progress is not None and rank == 0 else None
    on_finish = None
    if progress is not None and leader:
        on_finish = lambda index, result: progress.put(("done", index, result))  # noqa: E731
    if stats:
        links.reset(ctx, runner.model)
    results = dict(zip((r.index for r in mine), run_requests(runner, mine, report, on_finish=on_finish)))
    sent = None
    if stats:
        counted = links.rank_bytes(ctx, runner.model, compiled=runner.decode_step is not None)
        sent = _gather(counted, rank, world_size)
    if layout.dp > 1:
        parts = [None] * world_size if rank == 0 else None
        dist.gather_object(results if leader else {}, parts, dst=0)
        if rank == 0:
            results = {k: v for part in parts for k, v in part.items()}
    if rank != 0:
        return None
    ordered = [results[r.index] for r in requests]
    return (ordered, links.total(sent)) if stats else ordered


def _gather(mine, rank: int, world_size: int) -> list | None:
    """Every rank's `mine` on rank 0 (a list there, None elsewhere)."""
    if world_size == 1:
        return [mine]
    parts = [None] * world_size if rank == 0 else None
    dist.gather_object(mine, parts, dst=0)
    return parts


def _scaled_reporter(progress, dp: int):
    """Replica 0's counts, scaled to all dp replicas."""
    return lambda done, tokens: progress.put(("step", done * dp, tokens * dp))
