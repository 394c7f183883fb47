"""`atoll simulate`: a deployment under a load, simulated (planner/sim): atoll's own scheduler,
block pools, router and disaggregation decision, each step timed by the cost model on
--topology. It takes `atoll bench serve`'s load flags and the engine flags alike, so one command
line can be simulated here and run there, and prints the bench's table: throughput, mean and
percentiles of TTFT, TPOT, ITL and E2EL, SLO attainment and goodput, then each engine's busy
share and what its steps spent their time on."""

from __future__ import annotations

import json
import math
import sys

from tqdm import tqdm

from atoll.bench.serve import add_load_options, build_requests, check_load
from atoll.config import add_model_options, resolve
from atoll.engine.batch.router import ROUTERS
from atoll.errors import ConfigError
from atoll.models.gguf import demo_model_dir
from atoll.models.presets import resolve_model
from atoll.planner.sim.api import simulate
from atoll.planner.sim.deploy import from_engine_flags
from atoll.planner.sim.load import tokenized
from atoll.planner.sim.report import report_lines
from atoll.topologies import load_topology



def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="simulate a deployment under a load: bench serve's figures, predicted",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="preset (DeepSeek-V3, ...) or a HF config or checkpoint dir "
                                                 "(default: the demo model, SmolLM2-135M)")
    p.add_argument("--topology", default="local", help="preset or YAML (default local; `atoll calibrate` writes "
                                                       "a measured one)")
    p.add_argument("--nodes", type=int, default=None, help="number of nodes (default: the topology's)")
    p.add_argument("--replicas", type=int, default=None,
                   help="replicas of the layout behind the router (default 1; a dense model's -dp N means N too)")
    p.add_argument("--router", default="cache_aware", choices=ROUTERS, help="which replica takes a request")
    p.add_argument("--acceptance", type=float, default=None,
                   help="with --speculative-config: the chance each drafted token is kept (bench serve's "
                        "/metrics measure it)")
    p.add_argument("--draft-rate", type=float, default=1.0,
                   help="with --speculative-config: the share of decode steps that get a draft (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_load_options(p)
    engine = p.add_argument_group("engine flags, as `atoll serve` takes them")
    add_model_options(engine, defaults=resolve())
    p.set_defaults(run=run)


def run(args) -> int:
    slos, percentiles = check_load(args)
    if args.nodes is not None and not 1 <= args.nodes <= 4096:
        raise ConfigError(f"--nodes {args.nodes}: must be a whole number from 1 to 4096")
    topology = load_topology(args.topology, nodes=args.nodes)
    model = args.model or str(demo_model_dir())
    name, config = resolve_model(str(model))
    deployment = from_engine_flags(args, config, topology, replicas=args.replicas, router=args.router,
                                   acceptance=args.acceptance, draft_rate=args.draft_rate)
    requests = build(args, config, model)
    shown = not args.no_progress and sys.stderr.isatty()
    with tqdm(total=len(requests), desc="simulating", unit="req", file=sys.stderr, disable=not shown, delay=1.0,
              leave=False, mininterval=0.2) as bar:
        out = simulate(config, topology, deployment, requests, rate=args.request_rate, burstiness=args.burstiness,
                       max_concurrency=args.max_concurrency, seed=args.seed, slos=slos, percentiles=percentiles,
                       progress=bar.update, model_name=name)
    out = {"model": name, "num_prompts": len(requests),
           "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate, **out}
    print(json.dumps(out, indent=1) if args.json else render(out))
    return 0


def build(args, config, model) -> list:
    """The load's requests, as `atoll bench serve` builds them for the same flags; text prompts
    counted in the model's tokens."""
    return tokenized(build_requests(args, config, seed=args.seed), model)


def render(r: dict) -> str:
    rate = r["request_rate"] if r["request_rate"] == "inf" else f"{r['request_rate']:g}"
    lines = [f"{r['model']} simulated: {r['deployment']} on {r['topology']} ({r['gpus']} GPUs), "
             f"{r['num_prompts']} requests, rate {rate} req/s; steps from {r['steps_from']}",
             *report_lines(r["serve"])]
    if r.get("goodput_per_gpu") is not None:
        lines.append(f"  goodput per GPU {r['goodput_per_gpu']:.3f} req/s")
    for e in r["engines"]:
        busy = "-" if e["busy_share"] is None else f"{e['busy_share']:.2f}"
        bound = ", ".join(f"{b['what']} {b['share']:.0%}" for b in e["bound_by"])
        spec = ""
        if e["spec"]:
            s = e["spec"]
            spec = f"; drafts kept {s['accepted']}/{s['drafted']}"
        lines.append(f"  {e['engine']} ({e['layout']}): busy {busy}, {e['ticks']} ticks, "
                     f"{e['preemptions']} preemptions, {e['num_blocks']} KV blocks; steps: {bound}{spec}")
    if r["routed"]:
        lines.append("  routed: " + ", ".join(f"{k} {v}" for k, v in r["routed"].items()))
    lines.append(f"  simulated in {r['sim_wall_s']:.2f} s")
    return "\n".join(lines)
