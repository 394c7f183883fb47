"""`atoll calibrate` on a GPU node: the GPU and NCCL, measured with the runtime's own code.

- GEMM: fp32 and bf16 through the runtime's linear (calibrate.compute; x [rows, 8192] by
  weights [8192, 8192] streamed past the L2), and fp8 (e4m3, per-tensor scales) through
  torch._scaled_mm where this torch runs it on this GPU. The runtime itself upcasts fp8
  checkpoints (models/fp8.py), so the fp8 table is the tensor cores' rate that the planner's
  `--dtype fp8` assumes, not atoll's; where _scaled_mm does not run, fp8 is left out and
  `how` says why.
- HBM: `sum` (read) and `copy_` (read + write) of 1 GiB; the read figure is memory_gb_s and
  the topology's hbm_tb_s (a decode step reads its weights), the copy figure is in `how`.
- Overhead: the eager decode step of the tiny checkpoints, as on a CPU, each tick waiting
  for the GPU. Recorded, not costed: the runtime captures the GPU decode step in CUDA graphs,
  which skip this host dispatch (planner/runtime_terms.py).
- Collectives: NCCL, one process per GPU through launch.local.run_local, at each group size
  from 2 to the GPU count. One GPU has none: `how` says so and the planner uses the link
  figures of the preset for this GPU (or discovery's defaults).
"""

from __future__ import annotations

import os
import socket
import time

import torch
from tqdm import tqdm

from atoll.calibrate import collectives, compute
from atoll.calibrate.overheads import DTYPES, measure_overheads
from atoll.calibrate.compute import shape_for, stream_bytes_for
from atoll.calibrate.timing import sync, timed
from atoll.errors import AtollError, ConfigError
from atoll.launch.device import visible_gpus
from atoll.launch.local import run_local
from atoll.topologies.discover import discover, preset_for_gpu
from atoll.topologies.load import load_topology

QUICK_ROWS = (1, 4, 16, 64, 256, 1024, 4096)


def _sig(v: float) -> float:
    return float(f"{v:.4g}")


def fp8_gemm_tflops(budget_s: float, rows, *, device, shape=None,
                    stream_bytes: int | None = None) -> tuple[dict[int, float], str]:
    """({rows: TFLOP/s} of torch._scaled_mm, e4m3 x e4m3 -> bf16 with scale 1, "" or why some
    or all row counts were left out). Device-generic: a CPU build of torch may run it too."""
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return {}, f"torch {torch.__version__} has no torch._scaled_mm"
    k, n = shape or shape_for(device)
    e4m3 = torch.float8_e4m3fn
    count = max(2, (stream_bytes or stream_bytes_for(device)) // (k * n))
    ws = [torch.randn(n, k, device=device).to(e4m3) for _ in range(count)]
    one = torch.ones((), device=device)  # per-tensor scales, float32 as _scaled_mm wants them
    out, refused = {}, []
    with torch.inference_mode():
        for m in rows:
            x = torch.randn(m, k, device=device).to(e4m3)

            def run():
                for w in ws:  # w.t(): the column-major [k, n] operand _scaled_mm needs
                    torch._scaled_mm(x, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

            try:
                run()
                sync(device)
            except (RuntimeError, TypeError, NotImplementedError) as e:  # no fp8 tensor cores, or a shape it refuses
                refused.append((m, (str(e).splitlines() or [type(e).__name__])[0][:160]))
                continue
            out[m] = 2 * m * k * n * count / timed(run, budget_s, device=device) / 1e12
    why = "" if not refused else \
        f"torch._scaled_mm refused {', '.join(str(m) for m, _ in refused)} rows: {refused[0][1]}"
    return out, why


def nvlink_islands(gpus: int) -> list[list[int]] | None:
    """This node's NVLink-connected GPU sets as NVML or `nvidia-smi topo -m` show them, when
    they describe exactly the `gpus` GPUs torch sees; else None (not known)."""
    try:
        topo = discover()
    except (AtollError, OSError, ValueError):
        return None
    if topo.gpu.name == "cpu-core" or topo.gpus_per_node != gpus:  # nothing found, or CUDA_VISIBLE_DEVICES cut
        return None
    return [[g for _, g in island] for island in topo.islands]


def calibrate_gpu(device: str, *, quick: bool, max_ranks: int | None, progress: bool, command: str) -> dict:
    """The topology dict of this GPU node, measured on `device` (cuda:0, bound by the caller)."""
    gpus = visible_gpus()
    if max_ranks is not None and max_ranks > gpus:
        raise ConfigError(f"--max-ranks {max_ranks}: this node shows {gpus} GPU(s) and the collectives "
                          f"run one process per GPU; give at most {gpus}")
    max_ranks = max_ranks or gpus
    sizes = list(range(2, max_ranks + 1))
    budget = 0.02 if quick else 0.25
    rows = QUICK_ROWS if quick else compute.GPU_ROWS
    steps = ["memory", *(f"GEMM {d}" for d in (*DTYPES, "fp8")), "overhead dense", "overhead moe",
             *(f"collectives x{n}" for n in sizes)]
    bar = tqdm(total=len(steps), desc="calibrate", unit="step", disable=not progress, dynamic_ncols=True)
    props = torch.cuda.get_device_properties(device)
    started = time.perf_counter()
    cal: dict = {"device": "cuda", "cores": os.cpu_count() or 1, "gemm_tflops": {}, "memory_gb_s": {},
                 "overhead_us": {}, "collectives": {}}
    bar.set_postfix_str("memory")
    bw = compute.read_gb_s(budget, device=device) * 1e9
    copy = compute.copy_gb_s(budget, device=device)
    cal["memory_gb_s"][1] = _sig(bw / 1e9)
    bar.update()
    for name, dtype in DTYPES.items():
        bar.set_postfix_str(f"GEMM {name}")
        table = compute.gemm_tflops(getattr(torch, dtype), budget, rows=rows, device=device)
        cal["gemm_tflops"][name] = {m: _sig(v) for m, v in table.items()}
        bar.update()
    bar.set_postfix_str("GEMM fp8")
    fp8, why = fp8_gemm_tflops(budget, rows, device=device)
    if fp8:
        cal["gemm_tflops"]["fp8"] = {m: _sig(v) for m, v in fp8.items()}
    fp8_how = ("fp8 e4m3 through torch._scaled_mm (per-tensor scales; atoll's runtime upcasts fp8 weights)"
               + (f"; {why}" if why else "")) if fp8 else f"fp8 left out: {why}"
    bar.update()
    torch.cuda.empty_cache()  # the GEMM weights' memory back before the runtime and the ranks start
    measure_overheads(cal, bw, quick=quick, device=device, bar=bar)
    torch.cuda.empty_cache()
    for n in sizes:
        bar.set_postfix_str(f"collectives over {n} GPUs")
        res = run_local(collectives.collectives_rank, n, quick, timeout_s=600, device="cuda")[0]
        for op, fig in res["collectives"].items():
            cal["collectives"].setdefault(op, {})[n] = fig
        cal["memory_gb_s"][n] = _sig(res["memory_gb_s"])
        bar.update()
    bar.close()
    seconds = time.perf_counter() - started
    k, n = compute.shape_for(device)
    colls = (f"NCCL collectives over 2-{max_ranks} GPUs, one process per GPU (local launcher)" if sizes else
             "no collectives: one GPU (the planner uses the sourced link figures)")
    cal["how"] = (f"`{command}` on {socket.gethostname()} ({gpus} x {props.name}, {props.total_memory / 2**30:.1f} "
                  f"GiB), torch {torch.__version__}, CUDA {torch.version.cuda}; GEMM x [rows, {k}] by [{n}, {k}] "
                  f"through layers.packed.linear, {fp8_how}; HBM read "
                  f"{bw / 1e9:.0f} GB/s, copy {copy:.0f} GB/s (read + write); overhead from eager decode steps "
                  f"(no CUDA graphs), not used by the cost model; {colls}; every timing synchronized; "
                  f"{seconds:.0f} s{' (--quick: short timings, noisy)' if quick else ''}")
    cal["when"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    cal["seconds"] = round(seconds, 1)
    return gpu_topology_dict(cal, host=socket.gethostname(), gpu_name=props.name,
                             memory_gib=props.total_memory / 2**30, gpus=gpus, islands=nvlink_islands(gpus))


def _link(link) -> dict:
    d = {"kind": link.kind, "gb_s": link.gb_s, "latency_us": link.latency_us}
    return d | ({"shared": True} if link.shared else {})


def gpu_topology_dict(cal: dict, *, host: str, gpu_name: str, memory_gib: float, gpus: int,
                      islands: list[list[int]] | None = None) -> dict:
    """A GPU node as a topology, from its measured tables (pure: no CUDA). gpu: the GEMM
    tables' best rates and the read bandwidth; the link inside an island (NVLink when
    `islands` groups GPUs, else PCIe) from send_recv between two GPUs (else all_reduce); the
    links not measured here from the preset for this GPU name (data sheets), else the
    defaults discovery uses."""
    gemm = cal["gemm_tflops"]
    preset = preset_for_gpu(gpu_name)
    sourced = load_topology(preset) if preset else None
    pcie = _link(sourced.node_link) if sourced else {"kind": "pcie", "gb_s": 32.0, "latency_us": 5.0}
    network = (_link(sourced.network) if sourced else
               {"kind": "roce", "gb_s": 12.5, "latency_us": 8.0, "shared": True})
    nvlink = _link(sourced.island_link) if sourced and sourced.island_link.kind == "nvlink" else \
        {"kind": "nvlink", "gb_s": 25.0, "latency_us": 3.0}  # discovery's figure for one NVLink link
    colls = cal.get("collectives") or {}
    fig = colls.get("send_recv", {}).get(2) or colls.get("all_reduce", {}).get(2)
    measured = None if fig is None else {"gb_s": fig["gb_s"], "latency_us": fig["latency_us"]}
    grouped = islands is not None and any(len(i) > 1 for i in islands)
    links = {"pcie": pcie, "network": network}
    said = []
    if grouped:
        links["nvlink"] = {**nvlink, **(measured or {})}
        said.append("nvlink " + ("measured (send_recv or all_reduce over 2 GPUs)" if measured else "sourced"))
    elif measured:
        links["pcie"] = {**pcie, "kind": "pcie", **measured}
        said.append("pcie measured (send_recv or all_reduce over 2 GPUs)")
    said.append(f"other links from {'the ' + preset + ' preset' if sourced else 'discovery defaults'}, not measured")
    spec = {"name": gpu_name, "memory_gib": round(memory_gib, 2),
            "hbm_tb_s": round(cal["memory_gb_s"][min(cal["memory_gb_s"])] / 1e3, 4),
            "bf16_tflops": max(gemm["bf16"].values())}
    if gemm.get("fp8"):
        spec["fp8_tflops"] = max(gemm["fp8"].values())
    if gemm.get("fp32"):
        spec["fp32_tflops"] = max(gemm["fp32"].values())
    return {
        "name": f"calibrated-{host}",
        "gpus_per_node": gpus,
        "gpu": spec,
        "islands": islands if grouped else 1,
        "links": links,
        "notes": f"measured by atoll calibrate on {gpus} x {gpu_name}; see calibration.how; {'; '.join(said)}",
        "calibration": cal,
    }
