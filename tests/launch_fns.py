"""Rank functions the launcher tests run (module level, so Ray and mpirun ranks import them)."""

import os
import signal
import socket
import sys
import time
from pathlib import Path


def where() -> str:
    """This rank's node: the Ray node id inside a Ray actor, else the host name."""
    ray = sys.modules.get("ray")  # loaded inside a Ray actor; not imported elsewhere (slow)
    if ray is not None and ray.is_initialized():
        return ray.get_runtime_context().get_node_id()
    return socket.gethostname()


def collective(rank: int, world_size: int) -> dict:
    """A real all_reduce and all_gather over the launcher's process group."""
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    gathered = [torch.zeros(2) for _ in range(world_size)]
    dist.all_gather(gathered, torch.tensor([float(rank), float(rank * rank)]))
    return {"rank": rank, "node": where(), "pid": os.getpid(), "sum": total.item(),
            "gathered": [g.tolist() for g in gathered],
            "backend": dist.get_backend(), "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}


def _mark(stamp_dir) -> None:
    Path(stamp_dir, f"pid-{os.getpid()}").write_text(str(time.time()))


def raise_on_rank(rank: int, world_size: int, bad: int, stamp_dir: str):
    """Rank `bad` raises once every rank is up; the others wait in a collective forever."""
    import torch.distributed as dist

    dist.barrier()
    _mark(stamp_dir)
    if rank == bad:
        Path(stamp_dir, "failed-at").write_text(str(time.time()))
        raise ValueError(f"bad input on rank {rank}")
    dist.barrier()
    time.sleep(600)


def die_on_rank(rank: int, world_size: int, bad: int, stamp_dir: str):
    """Rank `bad` is SIGKILLed once every rank is up; the others wait in a collective."""
    import torch.distributed as dist

    dist.barrier()
    _mark(stamp_dir)
    if rank == bad:
        time.sleep(1.0)  # let every rank write its pid
        Path(stamp_dir, "failed-at").write_text(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    time.sleep(600)


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for c in children.get(p, []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _hex_addr(field: str) -> str:
    host, port = field.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:  # /proc/net/tcp6 stores four little-endian 32-bit words
        ip = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
    return f"{ip}:{int(port, 16)}"


def listening(root_pid: int) -> list[str]:
    """'addr:port' of every TCP socket that root_pid or a descendant of it listens on."""
    inodes = set()
    for pid in _descendants(root_pid) | {root_pid}:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                out.append(_hex_addr(f[1]))
    return sorted(out)


def listening_after_rendezvous(rank: int, world_size: int, driver_pid: int) -> list[str] | None:
    """Rank 0 lists what the whole job listens on, with the process group up."""
    import torch.distributed as dist

    dist.barrier()
    out = listening(driver_pid) if rank == 0 else None
    dist.barrier()
    return out


def generate_where(rank: int, world_size: int, spec, requests):
    """engine.worker's one-shot job, plus the node this rank ran on."""
    from atoll.engine.rank.job import EngineJob
    from atoll.engine.worker import worker

    return where(), worker(rank, world_size, EngineJob.colocated(spec), requests=requests)


def device_report(rank: int, world_size: int) -> dict:
    """What a Ray rank holds and sees, with every rank's reservation in place; rank 0 adds
    the job's placement-group bundles and the cluster's free GPUs at that moment."""
    import ray
    import torch.distributed as dist

    from atoll.launch.device import rank_device

    dist.barrier()  # every rank's actor is up and holds its share
    out = {"rank": rank, "node": where(), "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
           "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
           "assigned": ray.get_runtime_context().get_assigned_resources(),
           "gpu_index": os.environ.get("ATOLL_GPU_INDEX"),
           "device": rank_device(), "backend": dist.get_backend()}
    if rank == 0:
        pgs = [pg for pg in ray.util.placement_group_table().values()
               if pg["name"].startswith("atoll-") and pg["state"] == "CREATED"]
        out["bundles"] = [b for pg in pgs for b in pg["bundles"].values()]
        out["free_gpus"] = ray.available_resources().get("GPU", 0)
    dist.barrier()
    return out


def free_gpus_back(expected: float = 4.0, within_s: float = 15.0) -> float:
    """The Ray cluster's free GPUs once they are back to `expected`, or what they are after
    within_s (a job's actors release their reservation asynchronously)."""
    import ray

    end = time.monotonic() + within_s
    while True:
        free = ray.available_resources().get("GPU", 0)
        if free == expected or time.monotonic() > end:
            return free
        time.sleep(0.2)
