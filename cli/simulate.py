"""`atoll simulate`: a deployment under a load, simulated (planner/sim): atoll's own scheduler,
block pools, router and disaggregation decision, each step timed by the cost model on
--topology. It takes `atoll bench serve`'s load flags and the engine flags alike, so one command
line can be simulated here and run there, and prints the bench's table: throughput, mean and
percentiles of TTFT, TPOT, ITL and E2EL, SLO attainment and goodput, then each engine's busy
share and what its steps spent their time on.

KV cache tiers take the engine's flags: --kv-offload-gb GiB of host memory per rank, a disk tier
of --kv-disk-gb GiB per rank (a simulation has no directory: --kv-disk-dir alone is a disk as
large as it needs), and --kv-shared (a flag; the engine's URL is taken and ignored) a store of
unbounded size every replica shares. Their bandwidths are the topology's (`atoll calibrate`
measures them). --multi-turn sends bench serve --scenario kv-tiers's conversations."""

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
from atoll.planner.sim.load import multi_turn_requests, tokenized
from atoll.planner.sim.report import num, report_lines, tier_lines
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
    p.add_argument("--multi-turn", action="store_true",
                   help="--num-prompts conversations of --turns turns (bench serve --scenario kv-tiers's): a first "
                        "prompt of --input-len ids, then each turn the whole history (the last prompt, its answer, "
                        "--user-len new ids), sent when the turn before it ends; --max-concurrency 8 unless given")
    add_load_options(p)
    # "resolve": the tier flags below replace the engine's own for a simulation
    engine = p.add_argument_group("engine flags, as `atoll serve` takes them", conflict_handler="resolve")
    add_model_options(engine, defaults=resolve())
    engine.add_argument("--kv-disk-dir", default=None, metavar="DIR",
                        help="KV cache tiers: a disk tier (simulated: the directory is not used; without "
                             "--kv-disk-gb as large as it needs)")
    engine.add_argument("--kv-disk-gb", type=float, default=None, metavar="GB",
                        help="KV cache tiers: a disk tier of this many GiB per rank (simulated: no --kv-disk-dir "
                             "needed)")
    engine.add_argument("--kv-shared", nargs="?", const=True, default=False, metavar="URL",
                        help="KV cache tiers: a store every replica shares, of unbounded size (simulated: a flag; "
                             "the engine's file:// or redis:// URL is taken and not used)")
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
    if args.multi_turn:
        if not 1 <= args.turns <= 1000:
            raise ConfigError(f"--turns {args.turns}: must be a whole number from 1 to 1000")
        if args.dataset:
            raise ConfigError("--multi-turn makes its own prompts: drop --dataset")
        args.max_concurrency = args.max_concurrency or 8  # bench serve --scenario kv-tiers's default
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
    if args.multi_turn:
        return multi_turn_requests(args.num_prompts, turns=args.turns, input_len=args.input_len,
                                   user_len=args.user_len, output_len=args.output_len or 32,
                                   vocab_size=config.vocab_size, seed=args.seed)
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
    for k in r.get("kv_capacity", []):
        lines.append(f"  KV capacity per replica of {k['layout']}: {k['describe']}")
    if "kv_tiers" in r:
        lines += tier_lines(r["kv_tiers"])
    if "turns_ttft_ms" in r:
        t = r["turns_ttft_ms"]
        lines.append(f"  TTFT ms of first turns p50 {num(t['first'].get('p50'))}, of later turns p50 "
                     f"{num(t['later'].get('p50'))}")
    lines.append(f"  simulated in {r['sim_wall_s']:.2f} s")
    return "\n".join(lines)
