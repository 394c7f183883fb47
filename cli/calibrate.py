"""`atoll calibrate`: measure this machine with the runtime's own code and write a topology
YAML holding the figures and how they were measured (see atoll/calibrate)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tqdm import tqdm

from atoll.bench.serve_steps import measure_steps
from atoll.calibrate import calibrate, write_yaml
from atoll.errors import ConfigError, LayoutError
from atoll.models.config import ModelConfig
from atoll.parallel.layout import Layout
from atoll.topologies import load_topology


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate", help="measure this machine (GEMM, memory, per-layer overhead, collectives) into a topology YAML",
        description="Measure GEMM throughput at decode and prefill sizes per dtype, memory bandwidth, the runtime's "
                    "per-layer and per-step overhead, and all_reduce, all_gather, reduce_scatter, all_to_all, "
                    "broadcast and send/recv over the runtime's process groups at each group size; write a "
                    "topology YAML for `atoll plan --topology` (and `atoll plan --check`). With a GPU visible "
                    "it measures the GPU (fp32/bf16/fp8 GEMM, HBM) and NCCL between the node's GPUs; else one "
                    "CPU core per rank and gloo.")
    p.add_argument("--out", default="calibrated.yaml", help="topology YAML to write (default calibrated.yaml)")
    p.add_argument("--quick", action="store_true", help="short timings, a few seconds (for tests; noisy)")
    p.add_argument("--max-ranks", type=int, default=None,
                   help="largest group for the collectives (default: the core count, or the GPU count)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="what to measure: auto (a GPU if this machine shows one, else the CPU), cuda or cpu")
    p.add_argument("--steps", metavar="MODEL_DIR", action="append", default=None,
                   help="also time this checkpoint's engine steps as it serves (rows, chunk tokens, context) at "
                        "--step-layouts, for `atoll simulate` and `bench serve --compare-plan` (a few minutes a "
                        "layout); repeat for several models; MODEL_DIR:TP2,PP2 gives that model its own layouts")
    p.add_argument("--step-layouts", default="TP1",
                   help="--steps: layouts, comma-separated; 'N x TP1' serves N TP1 replicas together; a layout a "
                        "model cannot take (its heads) is skipped for that model (default TP1)")
    p.add_argument("--kv-disk-dir", default=None, metavar="DIR",
                   help="time the KV cache's disk tier in a temporary directory here (the disk `atoll serve "
                        "--kv-disk-dir` will use; default the system's temporary directory)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def run(args) -> int:
    out = Path(args.out).expanduser()
    if out.is_dir():
        raise ConfigError(f"--out {args.out}: is a directory; give a file such as {out / 'calibrated.yaml'}")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {args.out}: the directory {out.parent} does not exist")
    if not os.access(out.parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise ConfigError(f"--out {args.out}: not writable")
    if args.max_ranks is not None and not 2 <= args.max_ranks <= 64:
        raise ConfigError(f"--max-ranks {args.max_ranks}: must be between 2 and 64")

    command = "atoll calibrate" + (" --quick" if args.quick else "") + \
        (f" --max-ranks {args.max_ranks}" if args.max_ranks else "") + \
        (f" --device {args.device}" if args.device != "auto" else "")
    if args.kv_disk_dir is not None and not Path(args.kv_disk_dir).expanduser().is_dir():
        raise ConfigError(f"--kv-disk-dir {args.kv_disk_dir}: not a directory")
    data = calibrate(quick=args.quick, max_ranks=args.max_ranks, progress=not args.no_progress, command=command,
                     device=args.device,
                     disk_dir=None if args.kv_disk_dir is None else str(Path(args.kv_disk_dir).expanduser()))
    if args.steps:
        data["calibration"]["steps"] = steps_of(args)
    write_yaml(data, out)
    topo = load_topology(str(out))  # what was written reads back
    cal = topo.calibration
    o = cal.overhead_us
    print(f"wrote {out}: {topo.describe()}")
    print("  read bandwidth per rank: " + ", ".join(f"{n} at once {v:.1f} GB/s" for n, v in cal.memory_gb_s.items()))
    unit, scale = ("TFLOP/s", 1) if cal.gpu else ("GFLOP/s", 1e3)
    for dtype, table in cal.gemm_tflops.items():
        print(f"  GEMM {dtype} {unit} by rows: " + ", ".join(f"{m}: {v * scale:.1f}" for m, v in table.items()))
    print(f"  overhead us: step {o.get('step', 0):.0f}, per sequence {o.get('per_seq', 0):.1f}, "
          f"dense layer {o.get('dense_layer', 0):.1f}, MoE layer {o.get('moe_layer', 0):.1f}"
          + (" (eager steps; not used by the cost model)" if cal.gpu else ""))
    if not cal.collectives:
        print("  collectives: none measured (one rank); the planner uses the topology's link figures")
    for op, sizes in cal.collectives.items():
        print(f"  {op}: " + ", ".join(f"{n} ranks {lat * 1e6:.0f} us + {bw / 1e9:.2f} GB/s"
                                      for n, (lat, bw) in sizes.items()))
    t = topo.kv_tiers
    print(f"  KV tiers: host read {t.host.read_gb_s:.3g} GB/s, write {t.host.write_gb_s:.3g} GB/s; disk read "
          f"{t.disk.read_gb_s:.3g} GB/s, write {t.disk.write_gb_s:.3g} GB/s (blocks of SmolLM2-135M's size)")
    for model, layouts in cal.steps.items():
        for layout, f in layouts.items():
            rows = ", ".join(f"{r}: {us / 1e3:.1f}" for r, us in f["rows_us"].items())
            print(f"  {model} {layout} steps ms by rows: {rows}; + {f['chunk_token_us']:.0f} us a chunk token "
                  f"({f['samples']} ticks; fit off by {f.get('rel_median', 0):.1%} of the median tick, "
                  f"RMS {f['rel_rms']:.1%} of the mean)")
    print(f"  {cal.how}", file=sys.stderr)
    return 0


def steps_of(args) -> dict:
    """{model name: {layout: fitted steps}} for each --steps checkpoint at each --step-layouts
    layout it can take (checked before any server starts)."""
    plans = []
    for given in args.steps:
        path, colon, own = given.rpartition(":")
        if not colon:  # the model at --step-layouts
            path, own = given, ""
        texts = [t.strip() for t in (own or args.step_layouts).split(",") if t.strip()]
        model = Path(path).expanduser()
        if not (model / "config.json").is_file():
            raise ConfigError(f"--steps {given}: not a checkpoint directory (no config.json)")
        config, layouts = ModelConfig.load(model), []
        for t in texts:
            layout = Layout.parse(t.rpartition("x")[2].strip())  # a bad one fails here, before any server starts
            try:
                layout.validate(config)
            except (ConfigError, LayoutError) as e:
                print(f"atoll: --steps {model.name}: {t} skipped: {e}", file=sys.stderr)
                continue
            layouts.append(t)
        if not layouts:
            raise ConfigError(f"--steps {given}: takes none of the layouts {', '.join(texts)}")
        plans.append((model, layouts))
    out = {}
    with tqdm(total=sum(len(ls) for _, ls in plans), desc="engine steps", disable=args.no_progress,
              dynamic_ncols=True) as bar:
        for model, layouts in plans:
            out[model.name] = measure_steps(model, layouts, quick=args.quick, bar=bar)
    return out
