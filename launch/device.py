"""The one device rule: which device a rank computes on and which backend its collectives use.

Every launcher calls `decide` in the rank's process before any tensor or process group
exists, `agree` once the rendezvous store is up (so `auto` is CUDA only when every rank of
the job sees a GPU), then `bind`. Nothing else in atoll picks a device or a backend: the
launchers hand the bound device to the rank's function (launch.rank.call_rank: a function with
a `device` keyword gets it), and the runtime names it on every tensor it makes.

    requested  this rank sees a GPU for its local rank    does not
    cpu        cpu + gloo                                 cpu + gloo
    cuda       cuda:<local rank> + nccl                   one-line DeviceError
    auto       cuda:<local rank> + nccl if every rank     cpu + gloo
               does, else cpu + gloo everywhere

The local rank comes from the launcher: torchrun's LOCAL_RANK, Open MPI's
OMPI_COMM_WORLD_LOCAL_RANK (MPICH: MPI_LOCALRANKID, Slurm: SLURM_LOCALID), or the local and
Ray launchers, which pass it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from atoll.errors import AtollError

DEVICES = ("auto", "cuda", "cpu")
_LOCAL_RANK_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")
_bound: str | None = None


class DeviceError(AtollError):
    """A device that was asked for and cannot be had."""


def local_rank_from_env(env: Mapping[str, str] | None = None) -> int:
    """This process's index among the ranks of its node, as its launcher set it (0 if none)."""
    env = os.environ if env is None else env
    for name in _LOCAL_RANK_VARS:
        value = env.get(name)
        if value is not None and value.strip().isdigit():
            return int(value)
    return 0


def visible_gpus() -> int:
    """CUDA devices this process can see (0 with a CPU build of torch)."""
    import torch  # lazy: launch/ is torch-free until a rank runs

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_requested(requested: str) -> str:
    if requested not in DEVICES:
        raise DeviceError(f"device {requested!r} is not one of {', '.join(DEVICES)}")
    return requested


def decide(requested: str, local_rank: int, *, gpus: int | None = None, index: int | None = None) -> str:
    """This rank's device before agreement: "cuda:<i>" or "cpu". gpus: devices visible here
    (default: ask torch); index: the GPU to use when the launcher already knows it (Ray's
    assigned GPU), else local_rank."""
    check_requested(requested)
    if requested == "cpu":
        return "cpu"
    gpus = visible_gpus() if gpus is None else gpus
    index = local_rank if index is None else index
    if index < gpus:
        return f"cuda:{index}"
    if requested == "cuda":
        if gpus == 0:
            raise DeviceError("--device cuda but this rank sees no GPU (no CUDA device, or a CPU build of torch)")
        raise DeviceError(f"--device cuda: local rank {local_rank} needs GPU {index} but this node shows "
                          f"{gpus}; run at most {gpus} ranks per node or use --device cpu")
    return "cpu"


def agree(devices: list[str], requested: str) -> list[str]:
    """Every rank's final device from every rank's decision: with auto, CUDA only when all
    chose CUDA. With cuda every rank already has a GPU (decide raised otherwise)."""
    if requested == "auto" and any(d == "cpu" for d in devices):
        return ["cpu"] * len(devices)
    return list(devices)


def agree_through_store(store, rank: int, world_size: int, device: str, requested: str) -> str:
    """`agree` over a rendezvous store (torch.distributed.Store), before the process group."""
    store.set(f"atoll/device/{rank}", device)
    keys = [f"atoll/device/{r}" for r in range(world_size)]
    store.wait(keys)
    devices = [store.get(k).decode() for k in keys]
    return agree(devices, requested)[rank]


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def bind(device: str) -> str:
    """Make `device` this process's device (torch.cuda.set_device for a GPU); returns it."""
    global _bound
    if device.startswith("cuda"):
        import torch  # lazy: as above

        torch.cuda.set_device(torch.device(device))
    _bound = device
    return device


def rank_device() -> str:
    """The device the launcher bound in this process; "cpu" when none did (in-process use)."""
    return _bound or "cpu"

