"""Collectives over the runtime's own groups: every rank of a `world`-rank job (spawned by
launch.local.run_local, gloo on 127.0.0.1 on a CPU) builds ParallelContext.create(TP<world>)
and times each of its tp Group's collectives at a small and a large message, with a barrier
before each timed batch. Seconds per call = latency + bytes / bandwidth, the two solved from
the two sizes. Bytes as the cost model counts them: all_reduce, reduce_scatter and broadcast
the tensor; all_gather the gathered total; all_to_all what each rank sends; send_recv one
message (rank 0 to rank 1 and back, halved). While all ranks are up, each also reads a large
tensor at once with the others, and runs the GEMM probe (calibrate.compute.probe_tflops): the
memory bandwidth and the compute a rank gets beside `world` - 1 busy neighbours (on a machine
shared with other jobs, less than a core each even when there are enough cores).
"""

from __future__ import annotations

import statistics
import time

SMALL = 64  # bytes: the latency
LARGE = 4 * 2**20  # bytes: the bandwidth


def _batch(fn, reps: int, group) -> float:
    group.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def _per_call(fn, reps: int, group, rounds: int = 3) -> float:
    fn()  # warm-up: the first call of a gloo collective sets up its pairs
    return statistics.median(_batch(fn, reps, group) for _ in range(rounds))


def _ops(g, nbytes: int):
    import torch

    n = max(1, nbytes // 4)  # float32 elements
    size = g.size
    x = torch.ones(n)
    parts = max(1, n // size) * size
    xs = torch.ones(parts)
    out = {
        "all_reduce": lambda: g.all_reduce(x),
        "all_gather": lambda: g.all_gather(torch.ones(max(1, n // size)), dim=0),
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


def collectives_rank(rank: int, world: int, quick: bool) -> dict | None:
    import torch

    from atoll.launch.device import rank_device
    from atoll.parallel.layout import Layout
    from atoll.parallel.mesh import ParallelContext

    ctx = ParallelContext.create(Layout(tp=world), rank, rank_device())
    g = ctx.tp
    reps_small, reps_large = (20, 2) if quick else (200, 10)
    times = {}
    for label, nbytes, reps in (("small", SMALL, reps_small), ("large", LARGE, reps_large)):
        ops, real = _ops(g, nbytes)
        for op, fn in ops.items():
            t = _per_call(fn, reps, g)
            times.setdefault(op, {})[label] = (real, t / (2 if op == "send_recv" else 1))
    # memory read bandwidth with every rank reading at once
    big = torch.ones((64 if quick else 128) * 2**20 // 4)
    big.sum()
    g.barrier()
    reads = []
    for _ in range(3 if quick else 5):
        t0 = time.perf_counter()
        big.sum()
        reads.append(time.perf_counter() - t0)
    gb_s = torch.tensor([big.numel() * 4 / statistics.median(reads) / 1e9], dtype=torch.float64)
    g.all_reduce(gb_s)
    # the GEMM probe on every rank at once: what a rank computes beside `world` - 1 busy neighbours
    from atoll.calibrate.compute import probe_tflops

    g.barrier()
    rate = torch.tensor([probe_tflops(0.1 if quick else 0.5)], dtype=torch.float64)
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
    return {"collectives": figures, "memory_gb_s": float(gb_s[0]) / world, "probe_tflops": float(rate[0]) / world}
