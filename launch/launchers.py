"""Pick a launcher by name and run one function on every rank; the caller gets rank 0's value.

local: spawned processes here. ray: one actor per rank on a Ray cluster. torchrun / mpi:
this process is already one rank among many (launched by torchrun or mpirun).
Jobs that last (the living engine's ranks) start through launch.api's launcher objects:
LocalLauncher, RayLauncher, and launch.rank_job.RankLauncher under torchrun / mpirun, where
rank 0 is also the driver.
"""

from __future__ import annotations

import os

from atoll.errors import InputError
from atoll.launch.local import local_devices, run_local
from atoll.launch.mpi_launcher import _ENV_RANK, in_mpi, run_mpi
from atoll.launch.ray_launcher import run_ray
from atoll.launch.torchrun import in_torchrun, require_torchrun, run_torchrun

LAUNCHERS = ("auto", "local", "torchrun", "ray", "mpi")


def detect() -> str:
    if in_torchrun():
        return "torchrun"
    if in_mpi():
        return "mpi"
    return "local"


def is_first_rank(name: str) -> bool:
    """Whether this process is rank 0 of its job: always for local and Ray (the driver),
    by the launcher's variables under torchrun (RANK) and mpirun (its world rank)."""
    if name == "torchrun":
        return os.environ.get("RANK", "0") == "0"
    if name == "mpi":
        return next((os.environ[k] for k in _ENV_RANK if k in os.environ), "0") == "0"
    return True


def check_launcher(name: str, *, device: str = "cpu", world_size: int = 1) -> None:
    """torchrun and mpi join a job their launcher started: refuse them outside one. The local
    launcher's ranks all live here, so their devices are checked here too."""
    if name == "local":
        local_devices(device, world_size)

    if name == "torchrun":
        require_torchrun()


def launch(fn, world_size: int, *args, launcher: str = "auto", ray_address: str | None = None,
           device: str = "cpu", placement=None, strict_placement: bool = False, tp_size: int = 1,
           **kwargs) -> tuple[bool, object]:
    """(this process reports, rank 0's value). Under torchrun/mpi only rank 0 reports.
    device: auto, cuda or cpu, resolved per rank by launch.device. placement: a plan's
    rank -> (node, GPU); Ray places each rank there, torchrun/mpi check it (strict: refuse
    where they differ; Ray too, where it assigned other GPUs). tp_size: without a placement,
    Ray keeps each block of tp_size consecutive ranks (a TP group) on one node."""
    if launcher not in LAUNCHERS:
        raise InputError(f"unknown launcher {launcher!r}; choose one of {', '.join(LAUNCHERS)}")
    name = detect() if launcher == "auto" else launcher
    if name == "local":
        return True, run_local(fn, world_size, *args, device=device, **kwargs)[0]
    if name == "ray":
        return True, run_ray(fn, world_size, *args, address=ray_address, device=device, placement=placement,
                             strict_placement=strict_placement, tp_size=tp_size, **kwargs)[0]
    if name == "torchrun":
        rank, value = run_torchrun(fn, world_size, *args, device=device, placement=placement,
                                   strict_placement=strict_placement, **kwargs)
    else:
        rank, value = run_mpi(fn, world_size, *args, device=device, placement=placement,
                              strict_placement=strict_placement, **kwargs)
    return rank == 0, value
