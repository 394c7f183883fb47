"""One job, several engines: each engine owns a consecutive run of the job's ranks and builds
its ParallelContext over them alone (disaggregated prefill and decode: engine.disagg.roles).

Engine e holds job ranks base_e .. base_e + layout_e.world_size - 1. Its groups are the
rank grid of its own layout shifted by base_e, so its "world" is its own ranks, not the
job's. torch.distributed.new_group is collective over the whole job, so every process makes
every engine's groups, in the same order, and keeps those of its own engine.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from atoll.comm.group import Group
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ContextOptions, ParallelContext, group_ranks


def bases(layouts: list[Layout]) -> list[int]:
    """The first job rank of each engine."""
    out, at = [], 0
    for layout in layouts:
        out.append(at)
        at += layout.world_size
    return out


def engine_of(layouts: list[Layout], rank: int) -> tuple[int, int]:
    """(engine index, rank inside the engine) of a job rank."""
    for e, base in enumerate(bases(layouts)):
        if rank < base + layouts[e].world_size:
            return e, rank - base
    raise ValueError(f"rank {rank} outside a job of {sum(lay.world_size for lay in layouts)} ranks")


def create_part(layouts: list[Layout], rank: int, device="cpu",
                options: ContextOptions | None = None) -> tuple[int, ParallelContext]:
    """(engine index, this rank's ParallelContext inside its engine). All job ranks call it
    together. Every rank is taken to be on one host (the local launcher): one island."""
    total = sum(lay.world_size for lay in layouts)
    mine, local = engine_of(layouts, rank)
    groups = {}
    for e, (layout, base) in enumerate(zip(layouts, bases(layouts))):
        for kind, all_ranks in group_ranks(layout, None).items():
            for ranks in all_ranks:
                ranks = [base + r for r in ranks]
                pg = dist.new_group(ranks) if len(ranks) > 1 else None
                if e == mine and rank in ranks:
                    groups[kind] = Group(pg, ranks, rank, kind, device)
    # island ids indexed by job rank: the MoE dispatcher looks its ep group's (job) ranks up
    options = dataclasses.replace(options or ContextOptions(), islands=(0,) * total, nodes=(0,) * total)
    return mine, ParallelContext(layouts[mine], local, groups, device, options)
