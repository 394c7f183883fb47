"""`atoll calibrate`: measure this machine with the runtime's own code and describe it as a
topology YAML the planner reads (topologies/calibration.py holds the `calibration:` section).

    from atoll.calibrate import calibrate
    data = calibrate(quick=True)          # a dict: load_topology reads it once written as YAML

The device is the one launch.device picks for a first local rank: with a GPU visible (and
`device` auto or cuda) calibrate.gpu measures the GPU and NCCL; otherwise the CPU. On a CPU
machine one rank is one core (one thread), as the `local` preset counts it: the GEMM, memory
and overhead figures are one rank's, the collectives are gloo over 127.0.0.1 between ranks
spawned by the local launcher, at every group size from 2 to `max_ranks`.
"""

from __future__ import annotations

import os
import platform
import socket
import tempfile
import time
from pathlib import Path

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # the planner's name -> the runtime's (config.DTYPES)


def calibrate(*, quick: bool = False, max_ranks: int | None = None, progress: bool = True,
              command: str = "atoll calibrate", device: str = "auto") -> dict:
    """The topology dict of this machine, measured; `quick` takes a few seconds (for tests).
    device: auto, cuda or cpu, as launch.device decides it for local rank 0."""
    from atoll.launch.device import bind  # lazy: `atoll --help` imports this package (bench reads calibrate.timing)
    from atoll.launch.local import local_devices

    chosen = bind(local_devices(device, 1)[0])  # the one device rule: cuda:0 if this machine shows a GPU
    if chosen.startswith("cuda"):
        from atoll.calibrate.gpu import calibrate_gpu  # lazy: torch; and gpu imports this package

        return calibrate_gpu(chosen, quick=quick, max_ranks=max_ranks, progress=progress, command=command)
    return calibrate_cpu(quick=quick, max_ranks=max_ranks, progress=progress, command=command)


def calibrate_cpu(*, quick: bool, max_ranks: int | None, progress: bool, command: str) -> dict:
    import torch  # lazy: as in calibrate()
    from tqdm import tqdm

    from atoll.calibrate import collectives, compute
    from atoll.launch.local import run_local

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


def measure_overheads(cal: dict, bw: float, *, quick: bool, device, bar) -> None:
    """cal["overhead_us"] from eager decode steps of tiny checkpoints on `device` (see
    calibrate.compute), beyond their floor at read bandwidth `bw` (bytes/s) and the fp32 GEMM
    rates in cal["gemm_tflops"] (the tiny checkpoints are float32)."""
    from atoll.calibrate import compute  # lazy: as in calibrate()
    from atoll.topologies.calibration import Calibration

    rates = Calibration.from_dict({"gemm_tflops": cal["gemm_tflops"]})

    def gemm(m):
        return rates.gemm_flops("fp32", m)

    with tempfile.TemporaryDirectory(prefix="atoll-calibrate-") as tmp:
        out_tokens = 6 if quick else 24
        for kind, moe in (("dense", False), ("moe", True)):
            bar.set_postfix_str(f"overhead {kind}")
            samples = []
            for layers in (1, 5):
                d = compute_dir(Path(tmp), layers, moe)
                for seqs in ((1, 8) if not moe else (8,)):
                    step = compute.decode_step_s(d, seqs=seqs, out_tokens=out_tokens, device=device)
                    samples.append((layers, seqs, max(0.0, step - compute.floor_s(d, seqs, bw, gemm))))
            if not moe:
                tick, per_seq, per_layer, seq_layer = compute.fit_overheads(samples)
                cal["overhead_us"] |= {"step": round(tick * 1e6, 1), "per_seq": round(per_seq * 1e6, 2),
                                       "dense_layer": round(per_layer * 1e6, 2), "seq_layer": round(seq_layer * 1e6, 3)}
            else:  # the tick and per-sequence parts as the dense runs; per MoE layer the slope,
                # less the per-sequence part of its attention (the dense fit's)
                (n0, s, t0), (n1, _, t1) = samples
                attn = cal["overhead_us"].get("seq_layer", 0.0) * 1e-6 * s
                cal["overhead_us"]["moe_layer"] = round(max(0.0, (t1 - t0) / (n1 - n0) - attn) * 1e6, 2)
            bar.update()


def compute_dir(tmp: Path, layers: int, moe: bool) -> Path:
    from atoll.calibrate.tiny import write_tiny  # lazy: as in calibrate()

    d = tmp / f"{'moe' if moe else 'dense'}-{layers}"
    return d if (d / "config.json").exists() else write_tiny(d, layers=layers, moe=moe)


def topology_dict(cal: dict, cores: int) -> dict:
    """This machine as a topology: one node of `cores` ranks (one per core), the measured
    figures in gpu and links (the shared-memory link from send_recv between two ranks), and
    the whole calibration beside them for the cost model."""
    import psutil  # lazy: as in calibrate()

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


def write_yaml(data: dict, path: str | Path) -> None:
    import yaml  # lazy: as in calibrate()

    rank = "one GPU" if data.get("calibration", {}).get("device") == "cuda" else "one rank = one core"
    header = (f"# This machine, measured by `atoll calibrate` (atoll/calibrate). gpu: {rank};\n"
              "# calibration: the measured tables the planner's cost model uses (topologies/calibration.py).\n")
    Path(path).write_text(header + yaml.safe_dump(data, sort_keys=False, width=120))
