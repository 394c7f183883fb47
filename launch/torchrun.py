"""Running under torchrun (or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""

from __future__ import annotations

import os
import socket
import sys

from atoll.errors import LaunchError, LayoutError
from atoll.launch.device import agree_through_store, backend_for, bind, decide, local_rank_from_env
from atoll.launch.rank import call_rank
from atoll.parallel.placement import check_job_placement


def in_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def require_torchrun() -> None:
    """torchrun's job, or a LaunchError saying how to start one."""
    if not in_torchrun():
        raise LaunchError("--launcher torchrun needs torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, "
                          "MASTER_PORT): start with `torchrun --nproc-per-node N -m atoll generate ...`, "
                          "or use --launcher local")


def run_torchrun(fn, world_size: int, *args, device: str = "cpu", placement=None,
                 strict_placement: bool = False, **kwargs):
    """Join the process group torchrun prepared and run fn(rank, world_size, *args) here.
    The device follows launch.device from LOCAL_RANK, agreed with every rank through
    torchrun's rendezvous store before the process group (and its backend) exists.
    With a plan's placement every rank's host and LOCAL_RANK (its GPU) are checked against it:
    rank 0 prints one line naming the ranks that differ, or every rank refuses when strict."""
    import torch.distributed as dist

    require_torchrun()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != world_size:
        raise LayoutError(f"the layout needs {world_size} ranks but torchrun started {world}")
    chosen = decide(device, local_rank_from_env())
    if world > 1 and not dist.is_initialized():
        # the store env:// init would make (torchrun's agent store, or one served by rank 0)
        store, _, _ = next(dist.rendezvous("env://", rank, world))
        chosen = bind(agree_through_store(store, rank, world, chosen, device))
        dist.init_process_group(backend_for(chosen), store=store, rank=rank, world_size=world)
    else:
        bind(chosen)
    try:
        if placement is not None:
            check_placement(placement, rank, world, local_rank_from_env(), strict_placement, dist.is_initialized())
        return rank, call_rank(fn, rank, world, args, kwargs)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def check_placement(placement, rank: int, world: int, local_rank: int, strict: bool, gather: bool) -> None:
    """Every rank's (host, local rank) against the plan; rank 0 prints the one line."""
    import torch.distributed as dist

    me = (socket.gethostname(), local_rank)
    every = [None] * world
    if gather:
        dist.all_gather_object(every, me)
    else:
        every = [me]
    line = check_job_placement(placement, [h for h, _ in every], [g for _, g in every], strict=strict)
    if line and rank == 0:
        print(f"atoll: warning: {line}", file=sys.stderr, flush=True)
