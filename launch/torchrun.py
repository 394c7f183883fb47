"""Running under torchrun (or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""

from __future__ import annotations

import os

from atoll.errors import LayoutError


def in_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def run_torchrun(fn, world_size: int, *args, device: str = "cpu", **kwargs):
    """Join the process group torchrun prepared and run fn(rank, world_size, *args) here.
    The device follows launch.device from LOCAL_RANK, agreed with every rank through
    torchrun's rendezvous store before the process group (and its backend) exists."""
    import torch.distributed as dist

    from atoll.launch.device import agree_through_store, backend_for, bind, decide, local_rank_from_env

    from atoll.launch.launchers import check_launcher

    check_launcher("torchrun")
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
        return rank, fn(rank, world, *args, **kwargs)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
