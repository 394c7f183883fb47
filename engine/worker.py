"""The one worker entry every launcher calls on every rank."""

from __future__ import annotations

from atoll.engine.generate import Request, run_requests
from atoll.engine.runner import ModelRunner, RunSpec
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ParallelContext


def generate_worker(rank: int, world_size: int, spec: RunSpec, requests: list[Request]):
    """Build this rank's stage, run every request; rank 0 returns the results, others None."""
    layout = Layout.parse(spec.layout)
    ctx = ParallelContext.create(layout, rank) if world_size > 1 else ParallelContext.single()
    runner = ModelRunner(spec, ctx)
    results = run_requests(runner, requests)
    return results if rank == 0 else None
