"""`atoll plan --check`: the planner's predictions against runs of the runtime on this machine.

For each layout the planner predicts TTFT and TPOT for one replica on the given topology
(best `atoll calibrate`'s YAML of this machine), then the bench path (launch/bench_model:
`prepare` makes the requests and cache, `time_atoll` times run_batch) runs the same
workload on as many local ranks, one thread each (a CPU rank is one core, as the topology
counts it), eager: `batch` random prompts of `isl` tokens arriving together, each generating
`osl` tokens. Measured TTFT and TPOT are medians over requests, then over timed rounds; error
= predicted / measured - 1. The check runs a burst, not steady serving: every prompt is
prefilled before any decode step, and the decode steps carry no prompt chunks. So the
predictions it compares are the cost model's figures for that run, not the planner's
steady-state ones (planner/serving.py, with chunks mixed into decode and queueing for the
prefill): TTFT is the prefill of the burst (CostModel.prefill_burst), TPOT the pure decode step
of `batch` sequences (CostModel.decode with no prompt chunks). The prediction
takes the machine as one rank alone measured it at calibration, times the slowdown: the
calibration's GEMM probe (calibrate.compute.probe_tflops), run by every rank at once after
each timed round, outside the timed region, against its calibrated figure. On a machine
shared with other jobs the memory bandwidth and the core a rank gets move with their load
between calibration and check, and with the layout's own ranks.

Without --model: a random Llama (12 layers, hidden 768, ~100M parameters) at TP1, TP2, PP2 and
TP2PP2, and a random Qwen3-MoE (8 layers, 8 experts, top-2) at EP2 and DP2EP2, both written
once into the cache with calibrate.tiny.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from atoll.bench.harness import Run
from atoll.bench.model import prepare
from atoll.bench.model_rank import time_atoll
from atoll.calibrate.compute import PROBE_ROWS, probe_tflops
from atoll.calibrate.tiny import write_tiny
from atoll.engine.rank.runner import ModelRunner
from atoll.errors import ConfigError
from atoll.launch.local import run_local
from atoll.models.config import ModelConfig
from atoll.models.gguf import cache_dir
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ParallelContext
from atoll.parallel.placement import Placement
from atoll.planner import Workload, plan_layouts
from atoll.planner.cost import CostModel
from atoll.planner.shapes import shapes
from atoll.topologies import load_topology
from atoll.topologies.load import read_yaml

DENSE_LAYOUTS = ("TP1", "TP2", "PP2", "TP2PP2")
MOE_LAYOUTS = ("EP2", "DP2EP2")
CHECK_DENSE = dict(layers=12, hidden_size=768, num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                   intermediate_size=2048, vocab_size=16384, max_position_embeddings=2048)
CHECK_MOE = dict(layers=8, moe=True, hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                 intermediate_size=1024, moe_intermediate_size=512, num_experts=8, num_experts_per_tok=2,
                 vocab_size=8192, max_position_embeddings=2048)


def check_models(model: str | None, layouts: list[str] | None) -> list[tuple[str, str, list[str]]]:
    """(name, checkpoint dir, layouts) to run."""
    if model is not None:
        d = Path(model)
        if not (d / "config.json").is_file():
            raise ConfigError(f"--check runs the model: --model {model} must be a checkpoint directory")
        moe = ModelConfig.load(d).is_moe
        return [(d.name, str(d), layouts or list(MOE_LAYOUTS if moe else DENSE_LAYOUTS))]
    out = [("random Llama 100M", str(_random_dir("check-llama", CHECK_DENSE)), list(DENSE_LAYOUTS)),
           ("random Qwen3-MoE 65M", str(_random_dir("check-qwen3-moe", CHECK_MOE)), list(MOE_LAYOUTS))]
    if layouts:
        out = [(n, d, [x for x in layouts if x in lays]) for n, d, lays in out]
        out = [o for o in out if o[2]]
        if not out:
            raise ConfigError(f"--layouts {','.join(layouts)}: the default check runs "
                              f"{', '.join(DENSE_LAYOUTS + MOE_LAYOUTS)}; give --model for others")
    return out


def _random_dir(name: str, shape: dict):
    d = cache_dir() / name
    if not (d / "config.json").is_file():
        print(f"atoll: writing a random checkpoint once into {d}", file=sys.stderr, flush=True)
        write_tiny(d, **shape)
    return d


def topology_for(topology, world: int):
    """The topology with at least `world` ranks on its node (a CPU runs more ranks than cores;
    the cost model shares the cores among them), one island per rank as on a CPU."""
    if world <= topology.gpus_per_node:
        return topology
    node = dataclasses.replace(topology.nodes[0], gpus=world)
    return dataclasses.replace(topology, nodes=(node,), islands=tuple(((0, g),) for g in range(world)))


def predict(model_dir: str, topology, layout_text: str, *, batch: int, isl: int, osl: int) -> dict:
    config = ModelConfig.load(model_dir)
    layout = Layout.parse(layout_text).validate(config)
    topo = topology_for(topology, layout.world_size)
    workload = Workload(isl=isl, osl=osl, concurrency=batch, dtype="fp32", kv_dtype="fp32")  # CPU runs fp32
    plan = plan_layouts(config, topo, workload, layouts=[f"1 x {layout}"])  # validates, resolves the workload
    placement = Placement.build(layout, topo, allow_cross_island=True)
    cost = CostModel(config, shapes(config), topo, plan.workload, layout, placement, ranks=layout.world_size)
    # like with like: the bench's burst (all prompts, then pure decode), not steady serving
    tpot, decode, _ = cost.decode(batch)
    return {"ttft_s": cost.prefill_burst(batch), "tpot_s": tpot, "decode": decode}


def probe_ref(topology) -> float | None:
    """The calibration's probe figure: one rank alone, fp32 GEMM at 8 rows streaming its weights."""
    cal = topology.calibration
    return cal.gemm_tflops.get("fp32", {}).get(PROBE_ROWS) if cal is not None else None


def alone(topology, ranks: int):
    """The topology with its calibration as one rank alone measured it, for `ranks` ranks:
    what sharing the cores costs now comes from slowdown()."""
    cal = topology.calibration
    if cal is None or 1 not in cal.memory_gb_s:
        return topology
    one = dataclasses.replace(cal, cpu_share={n: 1.0 for n in range(1, ranks + 1)},
                              memory_gb_s={n: cal.memory_gb_s[1] for n in range(1, ranks + 1)})
    return dataclasses.replace(topology, calibration=one)


def _rank(rank: int, world: int, spec, requests, rounds: int, warmup: int, device: str = "cpu") -> dict | None:
    layout = Layout.parse(spec.layout)
    ctx = ParallelContext.create(layout, rank, device) if world > 1 else ParallelContext.single(device)
    with contextlib.redirect_stderr(io.StringIO()):  # the cache summary line would break the progress bar
        runner = ModelRunner(spec, ctx)
    mine = requests[ctx.coords.dp::layout.dp]  # each DP replica serves its own requests
    runs, probes = [], []
    for i in range(warmup + rounds):
        ctx.world.barrier()
        r = time_atoll(runner, mine)
        if i >= warmup:
            runs.append(r)
            ctx.world.barrier()  # every rank probes at once, between the timed rounds
            probes.append(probe_tflops(0.3))
    # every replica's medians, averaged: the DP replicas run side by side
    figs = torch.tensor([statistics.median(r["prefill_s"] for r in runs),
                         statistics.median(r["decode_step_s"] for r in runs), statistics.mean(probes)],
                        dtype=torch.float64)
    ctx.world.all_reduce(figs)
    figs /= world
    return {"ttft_s": float(figs[0]), "tpot_s": float(figs[1]), "probe_tflops": float(figs[2])} \
        if rank == 0 else None


def measure(model_dir: str, layout: str, *, batch: int, isl: int, osl: int, rounds: int, warmup: int) -> dict:
    llm, spec, requests = prepare(model_dir, layout, batch=batch, input_len=isl, output_len=osl, device="cpu",
                                  enforce_eager=True)
    return run_local(_rank, llm.layout.world_size, spec, requests, rounds, warmup, threads=1, timeout_s=1800,
                     device="cpu")[0]


def run_check(args) -> int:
    batch = args.concurrency_check
    isl, osl = args.isl or 32, args.osl or 24
    if osl < 2:
        raise ConfigError(f"--osl {osl}: a decode step needs at least 2 output tokens")
    if args.rounds < 1 or args.warmup < 0:
        raise ConfigError("--rounds must be >= 1 and --warmup >= 0")
    topology = load_topology(args.topology)
    if args.record and (topology.calibration is None or not os.path.isfile(args.topology)):
        raise ConfigError(f"--record writes into a calibrated topology file; {args.topology} is not one "
                          "(atoll calibrate --out FILE makes one)")
    if topology.calibration is None:
        print(f"atoll: warning: {args.topology} holds no calibration: the predictions use its assumed figures "
              "(run `atoll calibrate --out this.yaml` and check against that)", file=sys.stderr)
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()] if args.layouts else None
    todo = [(name, d, lay) for name, d, lays in check_models(args.model, layouts) for lay in lays]
    bench = Run(needs_model=False)
    ref = probe_ref(topology)
    rows = []
    for name, d, lay in tqdm(todo, desc="check", unit="layout", dynamic_ncols=True, disable=args.format == "json"):
        world = Layout.parse(lay).world_size
        pred = predict(d, alone(topology, world), lay, batch=batch, isl=isl, osl=osl)
        meas = measure(d, lay, batch=batch, isl=isl, osl=osl, rounds=args.rounds, warmup=args.warmup)
        # this machine between the rounds, every rank at once, against one rank alone at calibration
        slow = ref / meas["probe_tflops"] if ref else 1.0
        pred = {k: v * slow for k, v in pred.items() if k in ("ttft_s", "tpot_s")}
        rows.append({"model": name, "layout": lay, "slowdown": slow,
                     **{f"predicted_{k}": pred[k] for k in ("ttft_s", "tpot_s")},
                     **{f"measured_{k}": meas[k] for k in ("ttft_s", "tpot_s")},
                     "ttft_error": pred["ttft_s"] / meas["ttft_s"] - 1, "tpot_error": pred["tpot_s"] / meas["tpot_s"] - 1})
        bench.note()
    result = {"topology": args.topology, "batch": batch, "isl": isl, "osl": osl, "rounds": args.rounds, "rows": rows,
              "median_abs_tpot_error": statistics.median(abs(r["tpot_error"]) for r in rows),
              "median_abs_ttft_error": statistics.median(abs(r["ttft_error"]) for r in rows)}
    result = bench.record(result)
    if args.record:
        record(args.topology, result)
    bench.emit(result, as_json=args.format == "json", render=render, indent=1)
    return 0


def record(path: str, result: dict) -> None:
    """The check's median errors into the topology file's calibration.errors."""
    data = read_yaml(Path(path), path, "a topology YAML")
    data["calibration"]["errors"] = {
        "tpot": round(result["median_abs_tpot_error"], 4), "ttft": round(result["median_abs_ttft_error"], 4),
        "layouts": len(result["rows"]),
        "how": f"atoll plan --check, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
               f"{', '.join(map(str, result['load_avg_1m']))}"}
    text = Path(path).read_text()
    header = "".join(line + "\n" for line in text.splitlines() if line.startswith("#"))
    Path(path).write_text(header + yaml.safe_dump(data, sort_keys=False, width=120))
    print(f"atoll: recorded the median errors in {path}: later plans on it carry them as their band", file=sys.stderr)


def render(r: dict) -> None:
    t = Table(title=f"predicted vs measured on this machine ({r['cores']} cores): {r['batch']} requests of "
                    f"{r['isl']} tokens arriving together, {r['osl']} out each; medians of {r['rounds']} rounds",
              title_justify="left")
    for col in ("model", "layout", "slowdown", "TTFT pred ms", "TTFT meas ms", "error", "TPOT pred ms",
                "TPOT meas ms", "error"):
        t.add_column(col, justify="left" if col in ("model", "layout") else "right")
    for row in r["rows"]:
        t.add_row(row["model"], row["layout"], f"{row['slowdown']:.2f}", f"{row['predicted_ttft_s'] * 1e3:.1f}",
                  f"{row['measured_ttft_s'] * 1e3:.1f}", f"{row['ttft_error']:+.0%}",
                  f"{row['predicted_tpot_s'] * 1e3:.2f}", f"{row['measured_tpot_s'] * 1e3:.2f}",
                  f"{row['tpot_error']:+.0%}")
    Console(width=140).print(t)
    print(f"median |TPOT error| {r['median_abs_tpot_error']:.0%}, median |TTFT error| "
          f"{r['median_abs_ttft_error']:.0%} over {len(r['rows'])} layouts; topology {r['topology']}; "
          f"1-minute load average {', '.join(map(str, r['load_avg_1m']))}")
