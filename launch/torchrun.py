"""Running under torchrun (or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""

from __future__ import annotations

import os

from atoll.errors import LayoutError


def in_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def run_torchrun(fn, world_size: int, *args, **kwargs):
    """Join the process group torchrun prepared and run fn(rank, world_size, *args) here."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != world_size:
        raise LayoutError(f"the layout needs {world_size} ranks but torchrun started {world}")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world)
    try:
        return rank, fn(rank, world, *args, **kwargs)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
