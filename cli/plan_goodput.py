"""`atoll plan --goodput ttft:MS tpot:MS`: the SLO search (planner/sim/search.py) over layouts,
replicas, xPyD splits and engine options, each finalist simulated under the load; the
deployment with the highest goodput per GPU, or with --request-rate the fewest GPUs meeting
the SLOs, its why, the Pareto frontier (--plot) and a plan file carrying the whole deployment
(--save, for `atoll serve --plan`)."""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import asdict, replace

from tqdm import tqdm

from atoll.errors import ConfigError
from atoll.models.presets import resolve_model
from atoll.planner.planfile import from_search, save_plan
from atoll.planner.plot import plot_frontier
from atoll.planner.sim.api import simulate
from atoll.planner.sim.deploy import Deployment, on_cpu
from atoll.planner.sim.judge import MAX_REQUESTS, Target
from atoll.planner.sim.load import jsonl_requests, random_requests
from atoll.planner.sim.observed import factors, read_metrics
from atoll.planner.sim.report import parse_goodput
from atoll.planner.sim.search import search
from atoll.topologies import load_topology

MAX_RATE = 1e9
MAX_TOKENS = 1 << 24


def add_goodput_options(p) -> None:
    g = p.add_argument_group("the SLO search (with --goodput)")
    g.add_argument("--goodput", nargs="+", metavar="METRIC:MS", default=None,
                   help="search deployments for these SLOs (ttft, tpot, e2el in ms, as bench serve's "
                        "--goodput): each finalist simulated under the load (--isl/--osl or --dataset, "
                        "--request-rate); see docs/simulation.md")
    g.add_argument("--slo-attainment", type=float, default=0.9,
                   help="the share of requests that must meet every SLO (default 0.9: p90 SLOs)")
    g.add_argument("--dataset", metavar="FILE.jsonl", default=None,
                   help="a trace: one {\"prompt\": [token ids], \"output_len\": N} per line, instead of --isl/--osl")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="random lengths uniform in [(1-r) x, (1+r) x] of --isl and --osl (default 0)")
    g.add_argument("--burstiness", type=float, default=1.0, help="arrival burstiness, 1 = Poisson (bench serve's)")
    g.add_argument("--num-prompts", type=int, default=200,
                   help="requests each run simulates at least (more for a large deployment: its batch slots)")
    g.add_argument("--max-num-seqs", type=int, default=128, help="the engines' max_num_seqs the search starts from")
    g.add_argument("--enable-prefix-caching", action="store_true", help="the engines cache prefixes")
    g.add_argument("--acceptance", type=float, default=None,
                   help="try speculation too: the chance each drafted token is kept (a server's /metrics give it)")
    g.add_argument("--spec-tokens", type=int, default=4, help="with --acceptance: tokens drafted a step (default 4)")
    g.add_argument("--finalists", type=int, default=4, help="colocated layouts simulated (default 4)")
    g.add_argument("--no-disagg", action="store_true", help="colocated replicas only")
    g.add_argument("--seed", type=int, default=0, help="prompt and arrival seed (default 0)")
    g.add_argument("--from-metrics", metavar="URL", default=None,
                   help="correct by a running atoll server: its /metrics' mean TTFT and ITL over the simulated "
                        "ones of the deployment it serves (--serving) at the rate it saw (--serving-rate)")
    g.add_argument("--serving", metavar="DEPLOYMENT", default=None,
                   help="with --from-metrics: what the server runs, 'TP2', '2 x TP1' or '1P1D:TP1/TP2'")
    g.add_argument("--serving-rate", type=float, default=None,
                   help="with --from-metrics: the requests/s the server saw")


def check(args) -> tuple[dict, Target]:
    slos = parse_goodput(args.goodput)
    if not 0 < args.slo_attainment <= 1:
        raise ConfigError(f"--slo-attainment {args.slo_attainment}: must lie in (0, 1]")
    rate = args.request_rate
    if rate is not None and not 0 < rate <= MAX_RATE:
        raise ConfigError(f"--request-rate {rate:g}: must be a positive number of requests/s up to {MAX_RATE:g}")
    for flag, v in (("--isl", args.isl), ("--osl", args.osl)):
        if v is not None and not 1 <= v <= MAX_TOKENS:
            raise ConfigError(f"{flag} {v}: must be a whole number from 1 to {MAX_TOKENS}")
    if not 0 <= args.range_ratio < 1:
        raise ConfigError(f"--range-ratio {args.range_ratio}: must lie in [0, 1)")
    if not 0 < args.burstiness <= 1e6:
        raise ConfigError(f"--burstiness {args.burstiness}: must be a positive number")
    if not 1 <= args.num_prompts <= MAX_REQUESTS:
        raise ConfigError(f"--num-prompts {args.num_prompts}: must be a whole number from 1 to {MAX_REQUESTS}")
    if not 1 <= args.max_num_seqs <= 4096:
        raise ConfigError(f"--max-num-seqs {args.max_num_seqs}: must be a whole number from 1 to 4096")
    if args.acceptance is not None and not 0 <= args.acceptance <= 1:
        raise ConfigError(f"--acceptance {args.acceptance}: must lie in [0, 1]")
    if not 1 <= args.spec_tokens <= 64 or not 1 <= args.finalists <= 64:
        raise ConfigError("--spec-tokens and --finalists: whole numbers from 1 to 64")
    if args.from_metrics and (args.serving is None or args.serving_rate is None):
        raise ConfigError("--from-metrics needs --serving (the server's deployment: 'TP2', '2 x TP1', "
                          "'1P1D:TP1/TP2') and --serving-rate (the requests/s it saw)")
    if args.serving_rate is not None and not 0 < args.serving_rate <= MAX_RATE:
        raise ConfigError(f"--serving-rate {args.serving_rate:g}: must be a positive number of requests/s")
    return slos, Target(slos, args.slo_attainment, rate)


def serving_deployment(text: str, base: Deployment) -> Deployment:
    """'TP2', '2 x TP1' or '1P1D:TP1/TP2' as a Deployment with base's engine options."""
    t = text.strip()
    m = re.fullmatch(r"(\d+)P(\d+)D:([^/]+)/(.+)", t, flags=re.IGNORECASE)
    if m:
        return replace(base, prefill=m.group(3).strip(), decode=m.group(4).strip(),
                       prefill_replicas=int(m.group(1)), decode_replicas=int(m.group(2)))
    m = re.fullmatch(r"(\d+)\s*[xX*]\s*(.+)", t)
    if m:
        return replace(base, layout=m.group(2).strip(), replicas=int(m.group(1)))
    return replace(base, layout=t)


def correction(args, config, topology, base: Deployment, name: str) -> tuple[dict, str]:
    """Measured over simulated mean TTFT and ITL of the server (observed.py), and a line saying so."""
    seen = read_metrics(args.from_metrics)
    d = serving_deployment(args.serving, base)
    reqs = random_requests(max(200, seen.requests), input_len=max(1, round(seen.isl)),
                           output_len=max(1, round(seen.osl)), vocab_size=config.vocab_size, seed=args.seed)
    sim = simulate(config, topology, d, reqs, rate=args.serving_rate, seed=args.seed, model_name=name)
    f = factors(seen, sim["serve"])
    return f, (f"corrected by {seen.url} ({seen.requests} requests, mean {seen.isl:.0f} in / {seen.osl:.0f} out): "
               f"measured over simulated TTFT {f['ttft']:.2f}, ITL {f['itl']:.2f} for {d.describe()} at "
               f"{args.serving_rate:g} req/s")


def run_goodput(args) -> int:
    slos, target = check(args)
    if args.model is None:
        raise ConfigError("plan: the following arguments are required: --model (see `atoll plan --help`)")
    topology = load_topology(args.topology, nodes=args.nodes, gpus_per_node=args.gpus_per_node, network=args.network)
    name, config = resolve_model(args.model)
    isl, osl = args.isl or 1024, args.osl or 256
    if args.dataset:
        trace = jsonl_requests(args.dataset, 1, output_len=osl)  # checks every line, one-line errors
        if not isinstance(trace[0].prompt, list):
            raise ConfigError(f"--dataset {args.dataset}: the search takes token-id prompts "
                              "(\"prompt\": [ids]); text needs the model's tokenizer (`atoll simulate --model DIR`)")

        def make(n):
            return jsonl_requests(args.dataset, n, output_len=osl)
        sample = make(64)
        isl = round(sum(len(r.prompt) for r in sample) / len(sample))
        osl = round(sum(r.output_len for r in sample) / len(sample))
    else:
        def make(n):
            return random_requests(n, input_len=isl, output_len=osl, vocab_size=config.vocab_size, seed=args.seed,
                                   range_ratio=args.range_ratio)
    if isl + osl > config.max_position_embeddings:
        raise ConfigError(f"--isl {isl} + --osl {osl} exceeds {name}'s {config.max_position_embeddings} positions")
    cpu = on_cpu(topology)
    dtype = args.dtype if args.dtype != "auto" else ("fp32" if cpu else "auto")
    tiers = dict(kv_offload_gb=args.kv_offload_gb, kv_disk_gb=args.kv_disk_gb, kv_shared=args.kv_shared)
    if any(tiers.values()) and not args.enable_prefix_caching:
        raise ConfigError("KV cache tiers hold prefix blocks: give --enable-prefix-caching with them")
    base = Deployment(max_num_seqs=args.max_num_seqs, prefix_caching=args.enable_prefix_caching, dtype=dtype,
                      kv_dtype=args.kv_dtype if args.kv_dtype != "auto" else dtype, **tiers)
    note = None
    if args.from_metrics:
        f, note = correction(args, config, topology, base, name)
        target = replace(target, correction=f)
    shown = not args.no_progress and sys.stderr.isatty()
    with tqdm(desc="simulating deployments", unit="run", file=sys.stderr, disable=not shown, delay=1.0,
              leave=False, mininterval=0.2) as bar:
        result = search(config, topology, make, target, base=base, num_prompts=args.num_prompts, isl=isl, osl=osl,
                        burstiness=args.burstiness, seed=args.seed, model_name=name, acceptance=args.acceptance,
                        spec_tokens=args.spec_tokens, count=args.finalists, disagg=not args.no_disagg,
                        progress=bar.update)
    if note:
        result.reasons.append(note)
    if args.format == "json":
        print(json.dumps(to_dict(result, name, topology), indent=1))
    else:
        print(render(result, name, topology, isl, osl, args.top))
    if args.plot:
        plot_frontier(result, args.plot, title=f"{name} on {topology.name}: isl {isl}, osl {osl}")
        print(f"wrote {args.plot}", file=sys.stderr)
    if result.best is None:
        print(f"atoll: {result.reasons[0]}", file=sys.stderr)
        return 1
    if args.save:
        saved = from_search(result, config, topology, model=name, workload={"isl": isl, "osl": osl})
        save_plan(saved, args.save)
        print(f"wrote {args.save}: {saved.summary()}", file=sys.stderr)
    return 0


def _row(j) -> dict:
    t = j.closest
    d = j.deployment
    return {"deployment": d.describe(), "gpus": j.gpus, "max_num_seqs": d.max_num_seqs,
            "max_num_batched_tokens": d.max_num_batched_tokens, "kv_dtype": d.kv_dtype,
            "spec_tokens": d.spec_tokens, "meets": j.meets, "rate": j.rate,
            "goodput_per_gpu": j.goodput_per_gpu, "attainment": t.attainment if t else None,
            "p90_ttft_ms": t.serve["ttft_ms"]["p90"] if t else None,
            "p90_tpot_ms": t.serve["tpot_ms"]["p90"] if t else None, "steps_from": j.steps_from}


def to_dict(r, name: str, topology) -> dict:
    t = r.target
    return {"model": name, "topology": topology.name, "slos_ms": t.slos, "attainment": t.attainment,
            "request_rate": t.rate, "best": asdict(r.best.deployment) if r.best else None,
            "reasons": r.reasons, "deployments": [_row(j) for j in r.judged],
            "frontier": [{"tokens_per_s_per_user": x, "tokens_per_s_per_gpu": y, "at": what}
                         for x, y, what in r.frontier],
            "runs": r.runs, "wall_s": r.wall_s}


def render(r, name: str, topology, isl: int, osl: int, top: int) -> str:
    t = r.target
    load = f"at {t.rate:g} req/s" if t.rate else "at the highest rate each sustains"
    lines = [f"{name} on {topology.name} ({topology.num_gpus} GPUs): isl {isl}, osl {osl}, {t.describe()}, {load}",
             f"  {'deployment':<40}{'GPUs':>5}{'seqs':>6}{'kv':>6}{'rate/s':>9}{'/GPU':>8}{'attain':>8}"
             f"{'p90 TTFT':>10}{'p90 TPOT':>10}"]
    for j in r.judged[:top]:
        row = _row(j)
        mark = "*" if j is r.best else " "
        lines.append(f"{mark} {row['deployment'][:39]:<40}{row['gpus']:>5}{row['max_num_seqs']:>6}{row['kv_dtype']:>6}"
                     f"{_f(j.rate if j.meets else None, 3):>9}{_f(row['goodput_per_gpu'] if j.meets else None, 3):>8}"
                     f"{_f(row['attainment'], 3):>8}{_f(row['p90_ttft_ms'], 0):>10}{_f(row['p90_tpot_ms'], 1):>10}")
    lines += ["why:"] + [f"  - {x}" for x in r.reasons]
    if r.frontier:
        lines.append("Pareto frontier (output tok/s per user, per GPU): "
                     + ", ".join(f"{x:.0f}/{y:.0f}" for x, y, _ in r.frontier[:8]))
    return "\n".join(lines)


def _f(v, digits: int) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.{digits}g}" if digits > 1 else f"{v:.{digits}f}"
