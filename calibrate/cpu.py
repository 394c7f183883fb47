"""`atoll calibrate` on a CPU machine: one rank is one core (one thread), as the `local` preset
counts it; the GEMM, memory and overhead figures are one rank's, the collectives gloo over
127.0.0.1 between local ranks at every group size from 2 to `max_ranks`."""

from __future__ import annotations

import os
import platform
import socket
import time

import psutil
import torch
from tqdm import tqdm

from atoll.calibrate import collectives, compute
from atoll.calibrate.overheads import DTYPES, measure_overheads
from atoll.launch.local import run_local


def calibrate_cpu(*, quick: bool, max_ranks: int | None, progress: bool, command: str) -> dict:
    cores = os.cpu_count() or 1
    max_ranks = max_ranks or cores
    budget = 0.01 if quick else 0.25
    sizes = list(range(2, max_ranks + 1))
    steps = ["memory", *(f"GEMM {d}" for d in DTYPES), "overhead dense", "overhead moe",
             *(f"collectives x{n}" for n in sizes)]
    bar = tqdm(total=len(steps), desc="calibrate", unit="step", disable=not progress, dynamic_ncols=True)
    load = [os.getloadavg()[0]]
    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one rank, one core
    cal: dict = {"device": "cpu", "cores": cores, "gemm_tflops": {}, "memory_gb_s": {}, "cpu_share": {1: 1.0},
                 "overhead_us": {}, "collectives": {}}
    try:
        bar.set_postfix_str("memory")
        bw = compute.read_gb_s(budget) * 1e9
        cal["memory_gb_s"][1] = round(bw / 1e9, 3)
        bar.update()
        rows = compute.ROWS[:6] + (256,) if quick else compute.ROWS
        for name, dtype in DTYPES.items():
            bar.set_postfix_str(f"GEMM {name}")
            table = compute.gemm_tflops(getattr(torch, dtype), budget, rows=rows)
            cal["gemm_tflops"][name] = {m: round(v, 5) for m, v in table.items()}
            bar.update()
        measure_overheads(cal, bw, quick=quick, device="cpu", bar=bar)
        probe = compute.probe_tflops(0.1 if quick else 0.5)  # one rank alone, against the ranks at once below
    finally:
        torch.set_num_threads(threads)
    for n in sizes:
        bar.set_postfix_str(f"collectives over {n} ranks")
        res = run_local(collectives.collectives_rank, n, quick, threads=1, timeout_s=600)[0]
        for op, fig in res["collectives"].items():
            cal["collectives"].setdefault(op, {})[n] = fig
        cal["memory_gb_s"][n] = round(res["memory_gb_s"], 3)
        cal["cpu_share"][n] = round(min(1.0, res["probe_tflops"] / probe), 3)
        bar.update()
    bar.close()
    load.append(os.getloadavg()[0])
    seconds = time.perf_counter() - started
    cal["how"] = (f"`{command}` on {socket.gethostname()} ({platform.processor() or platform.machine()}, "
                  f"{cores} cores), torch {torch.__version__}, one thread per rank, gloo over 127.0.0.1 for "
                  f"2-{max_ranks} ranks; 1-minute load average {load[0]:.2f} before, {load[1]:.2f} after; "
                  f"{seconds:.0f} s{' (--quick: short timings, noisy)' if quick else ''}")
    cal["when"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    cal["load_avg_1m"] = [round(x, 2) for x in load]
    cal["seconds"] = round(seconds, 1)
    return topology_dict(cal, cores)



def topology_dict(cal: dict, cores: int) -> dict:
    """This machine as a topology: one node of `cores` ranks (one per core), the measured
    figures in gpu and links (the shared-memory link from send_recv between two ranks), and
    the whole calibration beside them for the cost model."""
    fp32, bf16 = cal["gemm_tflops"]["fp32"], cal["gemm_tflops"]["bf16"]
    sr = cal["collectives"].get("send_recv", {}).get(2, {"gb_s": 5.0, "latency_us": 10.0})
    ranks = max(cal["memory_gb_s"])
    return {
        "name": f"calibrated-{socket.gethostname()}",
        "gpus_per_node": cores,
        "gpu": {"name": "cpu-core", "memory_gib": round(psutil.virtual_memory().total / 2**30 / cores, 2),
                "hbm_tb_s": round(cal["memory_gb_s"][ranks] / 1e3, 6),
                "bf16_tflops": max(bf16.values()), "fp32_tflops": max(fp32.values())},
        "islands": 1,
        "links": {"pcie": {"kind": "shm", "gb_s": sr["gb_s"], "latency_us": sr["latency_us"]},
                  # not measured: one machine has no network; a placeholder as in the local preset
                  "network": {"kind": "ethernet", "gb_s": 1.25, "latency_us": 50, "shared": True}},
        "notes": "measured by atoll calibrate; see calibration.how",
        "calibration": cal,
    }

