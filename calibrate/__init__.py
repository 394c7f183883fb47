"""`atoll calibrate`: measure this machine with the runtime's own code and describe it as a
topology YAML the planner reads (topologies/calibration.py holds the `calibration:` section).

    from atoll.calibrate import calibrate
    data = calibrate(quick=True)          # a dict: load_topology reads it once written as YAML

The device is the one launch.device picks for a first local rank: with a GPU visible (and
`device` auto or cuda) calibrate.gpu measures the GPU and NCCL; otherwise the CPU. On a CPU
machine one rank is one core (one thread), as the `local` preset counts it: the GEMM, memory
and overhead figures are one rank's, the collectives are gloo over 127.0.0.1 between ranks
spawned by the local launcher, at every group size from 2 to `max_ranks`. Either way the KV
cache tiers' bandwidths (calibrate.tiers: host memory and a disk directory) go to `kv_tiers`.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from atoll.calibrate.cpu import calibrate_cpu
from atoll.calibrate.gpu import calibrate_gpu
from atoll.calibrate.tiers import measure_tiers
from atoll.launch.device import bind
from atoll.launch.local import local_devices


def calibrate(*, quick: bool = False, max_ranks: int | None = None, progress: bool = True,
              command: str = "atoll calibrate", device: str = "auto", disk_dir: str | None = None) -> dict:
    """The topology dict of this machine, measured; `quick` takes a few seconds (for tests).
    device: auto, cuda or cpu, as launch.device decides it for local rank 0. disk_dir: where
    to time the disk tier (default the system's temporary directory)."""
    chosen = bind(local_devices(device, 1)[0])  # the one device rule: cuda:0 if this machine shows a GPU
    if chosen.startswith("cuda"):
        data = calibrate_gpu(chosen, quick=quick, max_ranks=max_ranks, progress=progress, command=command)
    else:
        data = calibrate_cpu(quick=quick, max_ranks=max_ranks, progress=progress, command=command)
    data["kv_tiers"], how = measure_tiers(quick=quick, where=disk_dir)
    data["calibration"]["how"] += f"; {how}"
    return data


def write_yaml(data: dict, path: str | Path) -> None:
    rank = "one GPU" if data.get("calibration", {}).get("device") == "cuda" else "one rank = one core"
    header = (f"# This machine, measured by `atoll calibrate` (atoll/calibrate). gpu: {rank};\n"
              "# calibration: the measured tables the planner's cost model uses (topologies/calibration.py).\n")
    Path(path).write_text(header + yaml.safe_dump(data, sort_keys=False, width=120))
