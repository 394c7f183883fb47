"""Collectives over the runtime's own groups: every rank of a `world`-rank job (spawned by
launch.local.run_local: gloo on 127.0.0.1 on a CPU, one process per GPU with NCCL on a GPU
node) builds ParallelContext.create(TP<world>) and times each of its tp Group's collectives
at a small and a large message, with the device synchronized and a barrier before each timed
batch and the device synchronized after it. Seconds per call = latency + bytes / bandwidth,
the two solved from the two sizes. Bytes as the cost model counts them: all_reduce, reduce_scatter and broadcast
the tensor; all_gather the gathered total; all_to_all what each rank sends; send_recv one
message (rank 0 to rank 1 and back, halved). While all ranks are up, each also reads a large
tensor at once with the others, and on a CPU runs the GEMM probe
(calibrate.compute.probe_tflops): the memory bandwidth and the compute a rank gets beside
`world` - 1 busy neighbours (on a machine shared with other jobs, less than a core each even
when there are enough cores). A GPU has its own memory and compute: no probe there.
"""

from __future__ import annotations

import statistics
import time

import torch

from atoll.calibrate.compute import probe_tflops
from atoll.calibrate.timing import is_cuda, sync
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ParallelContext

SMALL = 64  # bytes: the latency
LARGE = 4 * 2**20  # bytes: the bandwidth
GPU_LARGE = 64 * 2**20  # NVLink moves 4 MiB in about as long as its latency: too small to tell them apart


def _batch(fn, reps: int, group, device) -> float:
    sync(device)
    group.barrier()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / reps


def _per_call(fn, reps: int, group, device, rounds: int = 3) -> float:
    fn()  # warm-up: the first call of a gloo collective sets up its pairs, of NCCL its communicator
    return statistics.median(_batch(fn, reps, group, device) for _ in range(rounds))


def _ops(g, nbytes: int, device):
    n = max(1, nbytes // 4)  # float32 elements
    size = g.size
    x = torch.ones(n, device=device)
    parts = max(1, n // size) * size
    xs = torch.ones(parts, device=device)
    shard = torch.ones(max(1, n // size), device=device)
    out = {
        "all_reduce": lambda: g.all_reduce(x),
        "all_gather": lambda: g.all_gather(shard, dim=0),
        "reduce_scatter": lambda: g.reduce_scatter(xs, dim=0),
        "all_to_all": lambda: g.all_to_all(xs, [parts // size] * size, [parts // size] * size),
        "broadcast": lambda: g.broadcast(x, src=0),
    }

    def ping():  # rank 0 <-> rank 1; other ranks idle
        if g.rank == 0:
            g.send(x, 1)
            g.recv(x.shape, x.dtype, 1)
        elif g.rank == 1:
            g.recv(x.shape, x.dtype, 0)
            g.send(x, 0)

    out["send_recv"] = ping
    return out, n * 4


def collectives_rank(rank: int, world: int, quick: bool, device: str = "cpu") -> dict | None:
    ctx = ParallelContext.create(Layout(tp=world), rank, device)
    g = ctx.tp
    gpu = is_cuda(device)
    reps_small, reps_large = (20, 2) if quick else (200, 10)
    times = {}
    for label, nbytes, reps in (("small", SMALL, reps_small), ("large", GPU_LARGE if gpu else LARGE, reps_large)):
        ops, real = _ops(g, nbytes, device)
        for op, fn in ops.items():
            t = _per_call(fn, reps, g, device)
            times.setdefault(op, {})[label] = (real, t / (2 if op == "send_recv" else 1))
    # memory read bandwidth with every rank reading at once
    big = torch.ones((1024 if gpu else 64 if quick else 128) * 2**20 // 4, device=device)
    big.sum()
    sync(device)
    g.barrier()
    reads = []
    for _ in range(3 if quick else 5):
        sync(device)
        t0 = time.perf_counter()
        big.sum()
        sync(device)
        reads.append(time.perf_counter() - t0)
    gb_s = torch.tensor([big.numel() * 4 / statistics.median(reads) / 1e9], dtype=torch.float64, device=device)
    g.all_reduce(gb_s)
    rate = torch.zeros(1, dtype=torch.float64, device=device)
    if not gpu:  # the GEMM probe on every rank at once: what a rank computes beside `world` - 1 busy neighbours
        g.barrier()
        rate += probe_tflops(0.1 if quick else 0.5)
        g.all_reduce(rate)
    if rank != 0:
        return None
    figures = {}
    for op, t in times.items():
        (b0, t0), (b1, t1) = t["small"], t["large"]
        if t1 > 1.2 * t0:  # two points: latency and bandwidth
            bw = (b1 - b0) / (t1 - t0)
            lat = max(0.0, t0 - b0 / bw)
        else:  # the large message took no longer (noise on a busy machine): all of it counts as bandwidth
            bw, lat = b1 / t1, t0
        figures[op] = {"latency_us": round(lat * 1e6, 2), "gb_s": round(bw / 1e9, 4)}
    return {"collectives": figures, "memory_gb_s": float(gb_s[0]) / world,
            "probe_tflops": None if gpu else float(rate[0]) / world}
