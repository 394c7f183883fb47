"""`atoll plan`: predicted TTFT / TPOT / tokens per second for every layout, the memory fit,
the recommendation and why."""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
import os
import sys
from pathlib import Path

from atoll.cli.plan_goodput import add_goodput_options, run_goodput
from atoll.config.engine import EngineConfig
from atoll.errors import ConfigError
from atoll.models.presets import resolve_model
from atoll.planner import Workload, moe_options, plan_sweep
from atoll.planner.memory import device_kv_blocks, kv_capacity, memory_fit
from atoll.planner.planfile import check_save_path, from_plan, save_plan
from atoll.planner.plot import plot_plans
from atoll.planner.progress import SearchProgress
from atoll.planner.shapes import shapes as model_shapes
from atoll.planner.table import print_plans
from atoll.topologies import load_topology

ENGINE = EngineConfig()  # the engine's defaults: block size and gpu_memory_utilization


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("plan", help="recommend a parallel layout for a model on a cluster",
                              description="Search every layout (TP, PP, DP, EP, replicas), fit memory, "
                                          "predict latency and throughput, recommend one.")
    p.add_argument("--model", default=None,
                   help="built-in preset (DeepSeek-V3, Llama-3.1-405B, ...) or a HF config dir/file "
                        "(with --check: a checkpoint directory; default two random models)")
    p.add_argument("--topology", required=True, help="preset (dgx-h200, ...) or a topology YAML file")
    p.add_argument("--nodes", type=int, default=None, help="number of nodes (default: the file's)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="use only this many GPUs per node")
    p.add_argument("--network", default=None, help="replace the inter-node link: ethernet:25, infiniband:400")
    p.add_argument("--isl", type=int, default=None, help="input tokens per request (default 1024; --check 32)")
    p.add_argument("--osl", type=int, default=None, help="output tokens per request (default 256; --check 24)")
    p.add_argument("--concurrency", default=None,
                   help="requests in flight; a list sweeps: 1,8,64,256 (default 64; --check 8)")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp8", "fp32"), default="auto",
                   help="weight precision (default auto: the checkpoint's, e.g. fp8 for DeepSeek-V3)")
    p.add_argument("--quantization", choices=("int8", "fp8"), default=None,
                   help="the runtime's --quantization: weights counted as its ranks allocate them "
                        "(planner/quantized.py; default: --dtype's bytes per parameter)")
    p.add_argument("--kv-dtype", choices=("auto", "bf16", "fp8", "fp32", "fp8_e4m3", "fp8_e5m2", "int8"), default="auto",
                   help="KV cache precision, about 2x the requests per GPU from bf16 to fp8 or int8; the "
                        "runtime's --kv-cache-dtype names count its bytes (int8: + a float32 scale per token "
                        "and head) (default auto: bf16, fp32 under fp32 weights)")
    p.add_argument("--request-rate", type=float, default=None,
                   help="new requests per second, Poisson arrivals (default: closed loop at --concurrency)")
    p.add_argument("--expert-imbalance", type=float, default=None,
                   help="MoE: busiest EP rank's routed tokens over the mean, >= 1 (default: derived from the "
                        "placement and a gate model fitted to TensorRT-LLM's measurement, or --expert-loads)")
    p.add_argument("--expert-loads", default=None, metavar="FILE",
                   help="MoE: a recorded expert load (`atoll generate --expert-load-out FILE`): the imbalance of "
                        "each layout and placement computed from it")
    p.add_argument("--enable-eplb", choices=("auto", "on", "off"), default="auto",
                   help="MoE: expert placement by load (the runtime's --enable-eplb); auto: the search tries it "
                        "with one spare slot a rank on every EP layout and keeps it where it is faster")
    p.add_argument("--num-redundant-experts", type=int, default=None, metavar="R",
                   help="MoE: spare expert slots with EPLB (implies --enable-eplb on)")
    p.add_argument("--two-batch-overlap", choices=("auto", "on", "off"), default="auto",
                   help="MoE: steps as two micro-batches, one's all-to-all under the other's compute; auto: the "
                        "search tries both on every EP layout")
    p.add_argument("--kv-offload-gb", type=float, default=0.0, metavar="GB",
                   help="KV cache tiers (as `atoll serve` takes them): GiB of host memory per rank; the plan says how "
                        "many tokens of prefix each replica keeps there, beside its device pool (with --goodput "
                        "the search simulates them)")
    p.add_argument("--kv-disk-gb", type=float, default=0.0, metavar="GB",
                   help="KV cache tiers: a disk tier of this many GiB per rank (as --kv-offload-gb)")
    p.add_argument("--kv-shared", action="store_true",
                   help="KV cache tiers: a store every replica shares, of unbounded size (as --kv-offload-gb)")
    p.add_argument("--ttft-ms", type=float, default=None, help="SLO: time to first token")
    p.add_argument("--tpot-ms", type=float, default=None, help="SLO: time per output token")
    p.add_argument("--layouts", default=None, help="only these, comma-separated: TP8PP2,EP16,'2 x TP8'")
    p.add_argument("--allow-cross-island", action="store_true", help="let TP groups span NVLink islands")
    p.add_argument("--max-cp", type=int, default=None, metavar="N",
                   help="context parallelism: search cp degrees up to N (1: none). Default: none below "
                        "32768 input tokens, else one cp rank per 16384 input tokens, rounded up: 8 at 128k")
    p.add_argument("--top", type=int, default=10, help="rows of the table (default 10)")
    p.add_argument("--format", choices=("table", "json", "csv"), default="table")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar on stderr (none is drawn off a terminal, or for a plan under a second)")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="Pareto plot (needs matplotlib)")
    p.add_argument("--save", metavar="PLAN.yaml", default=None,
                   help="write the recommended plan (layout, rank -> node/GPU placement, topology, predictions) "
                        "for `atoll generate --plan`; with several --concurrency values, the first one's")
    p.add_argument("--check", action="store_true",
                   help="run the layouts on this machine with the runtime and print predicted against measured "
                        "TTFT and TPOT (use the topology `atoll calibrate` wrote)")
    p.add_argument("--record", action="store_true",
                   help="--check: write the median errors into the topology YAML (calibration.errors): later "
                        "plans on it carry them as their uncertainty band")
    p.add_argument("--rounds", type=int, default=3, help="--check: timed rounds per layout (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="--check: untimed rounds first (default 1)")
    add_goodput_options(p)
    p.set_defaults(run=run)


def _concurrencies(text: str) -> list[int]:
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--concurrency {text!r}: expected integers like 64 or 1,8,64") from None
    if not values or min(values) < 1:
        raise ConfigError(f"--concurrency {text!r}: every value must be at least 1")
    return values


# what matplotlib's savefig writes, by file extension (no extension: png)
PLOT_FORMATS = ("png", "pdf", "svg", "svgz", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp",
                "pgf", "raw", "rgba")


def check_plot_path(path: str) -> None:
    """Before any work: --plot must name a writable file whose format matplotlib writes."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise ConfigError(f"--plot {path}: is a directory; give a file such as {p / 'plan.png'}")
    parent = p.parent
    if not parent.is_dir():
        why = "is a file" if parent.exists() else "does not exist"
        raise ConfigError(f"--plot {path}: the directory {parent} {why}; create it or pick another path")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ConfigError(f"--plot {path}: not writable")
    ext = p.suffix.lower().lstrip(".")
    if ext and ext not in PLOT_FORMATS:
        raise ConfigError(f"--plot {path}: cannot write .{ext} files; use one of "
                          f"{', '.join('.' + f for f in PLOT_FORMATS[:6])}")
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("--plot needs matplotlib: pip install 'atoll[plot]'")


def check_tiers(args) -> None:
    for flag, v in (("--kv-offload-gb", args.kv_offload_gb), ("--kv-disk-gb", args.kv_disk_gb)):
        if not 0 <= v < float("inf"):
            raise ConfigError(f"{flag} {v}: must be a number of GiB of at least 0")


def kv_capacities(plans, config, topology, args) -> list:
    """Each concurrency's recommended layout's KV capacity per replica (per DP replica inside it:
    one scheduler's pool and its ranks' tiers; planner/memory.py), at the engine's default block
    size and gpu_memory_utilization; None where none was recommended."""
    out, sh = [], model_shapes(config)
    for plan in plans:
        best = plan.recommended
        if best is None:
            out.append(None)
            continue
        w = plan.workload.resolved(config)
        one = memory_fit(config, sh, topology, w, best.layout, 1)
        blocks = device_kv_blocks(one, topology, w, utilization=ENGINE.gpu_memory_utilization,
                                  block_size=ENGINE.block_size)
        out.append(kv_capacity(one, w, device_blocks=blocks, block_size=ENGINE.block_size, host_gib=args.kv_offload_gb,
                               disk_gib=args.kv_disk_gb, shared=args.kv_shared))
    return out


def run(args) -> int:
    check_tiers(args)
    if args.check:
        # lazy: --check runs models (torch); a plan without it never imports torch
        from atoll.bench.plan_check import run_check

        args.concurrency_check = _concurrencies(args.concurrency or "8")[0]
        return run_check(args)
    if args.goodput:
        if args.plot:
            check_plot_path(args.plot)
        if args.save:
                check_save_path(args.save)
        return run_goodput(args)
    if args.model is None:
        raise ConfigError("plan: the following arguments are required: --model (see `atoll plan --help`)")
    args.isl = 1024 if args.isl is None else args.isl
    args.osl = 256 if args.osl is None else args.osl
    args.concurrency = args.concurrency or "64"
    if args.nodes is not None and args.nodes < 1:
        raise ConfigError(f"--nodes {args.nodes}: must be at least 1")
    if args.top < 1:
        raise ConfigError(f"--top {args.top}: must be at least 1")
    if args.max_cp is not None and args.max_cp < 1:
        raise ConfigError(f"--max-cp {args.max_cp}: must be at least 1 (1: no context parallelism)")
    for flag, v in (("--ttft-ms", args.ttft_ms), ("--tpot-ms", args.tpot_ms)):
        if v is not None and not 0 < v < float("inf"):
            raise ConfigError(f"{flag} {v}: an SLO must be a positive number of milliseconds")
    if args.plot:
        check_plot_path(args.plot)
    if args.save:
        check_save_path(args.save)

    topology = load_topology(args.topology, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                             network=args.network)
    name, config = resolve_model(args.model)
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()] if args.layouts else None
    moe = moe_options.from_flags(args.enable_eplb, args.num_redundant_experts, args.two_batch_overlap,
                                 args.expert_loads)
    workloads = [Workload(isl=args.isl, osl=args.osl, concurrency=c, dtype=args.dtype, kv_dtype=args.kv_dtype,
                          quantization=args.quantization, request_rate=args.request_rate,
                          expert_imbalance=args.expert_imbalance, **moe.fields)
                 for c in _concurrencies(args.concurrency)]
    with SearchProgress(enabled=not args.no_progress) as progress:  # every layout costed once for all
        plans = plan_sweep(config, topology, workloads, ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms, layouts=layouts,
                           allow_cross_island=args.allow_cross_island, max_cp=args.max_cp, progress=progress,
                           eplb=moe.eplb, tbo=moe.tbo)
    plans = [_renamed(p, name) for p in plans]
    tiered = bool(args.kv_offload_gb or args.kv_disk_gb or args.kv_shared)
    capacities = kv_capacities(plans, config, topology, args) if tiered else [None] * len(plans)
    if args.format == "json":
        out = [p.to_dict() | ({"kv_capacity_tokens": c.tokens()} if c is not None else {})
               for p, c in zip(plans, capacities)]
        json.dump(out[0] if len(out) == 1 else out, sys.stdout, indent=1)
        print()
    elif args.format == "csv":
        _csv(plans)
    else:
        print_plans(plans, top=args.top)
        for p, c in zip(plans, capacities):
            if c is not None:
                print(f"KV capacity per replica of {p.recommended.name} at concurrency {p.workload.concurrency}: "
                      f"{c.describe()}")
    if args.plot:
        plot_plans(plans, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.save:
        saved = from_plan(plans[0], config)
        save_plan(saved, args.save)
        print(f"wrote {args.save}: {saved.summary()}", file=sys.stderr)
    return _closest_miss(plans)


def _closest_miss(plans) -> int:
    """0 when every concurrency has a recommendation; else one line per concurrency without one
    (no layout fits, or none meets the SLOs: the closest miss) on stderr, and 1."""
    missed = [p for p in plans if p.recommended is None]
    for p in missed:
        print(f"atoll: concurrency {p.workload.concurrency}: {p.reasons[0]}", file=sys.stderr)
    return 1 if missed else 0


def _renamed(plan, name):
    return dataclasses.replace(plan, model=name)


def _csv(plans) -> None:
    cols = ["concurrency", "dtype", "kv_dtype", "name", "layout", "replicas", "gpus", "fits", "memory_used_gib",
            "memory_capacity_gib", "shortfall_gib", "ttft_ms", "tpot_ms", "tokens_per_s_per_gpu",
            "tokens_per_s_per_user", "meets_slo", "recommended", "reason"]
    w = csv.writer(sys.stdout)
    w.writerow(cols)
    for plan in plans:
        for p in plan.predictions:
            d, m = p.to_dict(), p.to_dict()["memory_gib"]
            w.writerow([plan.workload.concurrency, plan.workload.dtype, plan.workload.kv_dtype, p.name,
                        d["layout"], p.replicas, p.gpus, p.fits,
                        f"{m['used']:.2f}", f"{m['capacity']:.2f}", f"{m['shortfall']:.2f}",
                        f"{d['ttft_ms']:.3f}", f"{d['tpot_ms']:.4f}", f"{p.tokens_per_s_per_gpu:.3f}",
                        f"{p.tokens_per_s_per_user:.3f}", p.meets_slo, p is plan.recommended, p.reason])
