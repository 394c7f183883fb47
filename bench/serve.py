"""atoll bench serve: an OpenAI-compatible server under load, measured as vLLM's serving
benchmark measures it, against --url or a `python -m atoll serve` it starts itself on a free
127.0.0.1 port with the engine flags given (--layout, --max-num-seqs, ...) and ends by pid.

Load: open loop, --request-rate requests/s (inf: all at once) with gamma-distributed gaps of
shape --burstiness (1: Poisson), capped at --max-concurrency requests in flight (with rate inf,
a closed loop). --num-prompts requests of --input-len random token ids generating
--output-len tokens each (ignore_eos), or the prompts of a --dataset JSONL; each round new
random prompts (a prompt sent again would find its prefix cached; a dataset's are sent again).
Two other requests, sent at once, warm the server first. Reported: request and token throughput; mean
and percentiles of TTFT, TPOT, ITL and E2EL; with --goodput ttft:MS tpot:MS e2el:MS, SLO
attainment and goodput (planner/sim/report.py). --compare-plan puts the planner's prediction
for the same model, layout, topology and workload beside the measured means; --compare-offline
runs the same requests through LLM.generate in this process, first, then on the server, for
--rounds rounds (the order alternating), and prints both output throughputs and the ratio of
their medians (bench/serve_compare.py); the full figures are the first round's. --scenario
long-prompt: the streams' ITL while a long prompt arrives, with the default chunk budget and
without chunking (bench/serve_scenario.py). --scenario routing: cache-aware routing against
round-robin over --data-parallel-size replicas, on requests sharing --system-prompts
prefixes (bench/serve_routing.py). --scenario disagg: colocated against --prefill/--decode
serving on requests with a --long-share of --long-len prompts (bench/serve_disagg.py).
--scenario kv-tiers: multi-turn chat served with no KV tiers, a host tier and host plus disk
(bench/serve_tiers.py). The 1-minute load average is read before,
between and after the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import statistics
import time

from atoll.bench.chaos import render as render_chaos, run_chaos
from atoll.bench.harness import Run, sig
from atoll.bench.serve_compare import Offline, compare_plan, plan_lines, spec_counts, spec_rates
from atoll.bench.serve_cycles import Cycles, cycle_lines
from atoll.bench.serve_disagg import render as render_disagg, run_disagg
from atoll.bench.serve_load import run_load as load, served_model, warm_up
from atoll.bench.serve_probe import PROBE_SEED, Probe
from atoll.bench.serve_routing import render as render_routing, run_routing, scrape
from atoll.bench.serve_scenario import render as render_long, run_long_prompt
from atoll.bench.serve_tiers import render as render_tiers, run_tiers
from atoll.bench.serve_server import Server, engine_argv
from atoll.config import add_model_options, resolve
from atoll.errors import ConfigError
from atoll.models.config import ModelConfig
from atoll.planner.sim.load import jsonl_requests, mixed_requests, random_requests, shared_prefix_requests
from atoll.planner.sim.report import num as _f, parse_goodput, parse_percentiles, report, report_lines

SCENARIOS = ("load", "long-prompt", "routing", "disagg", "kv-tiers")
PROMPTS = ("random", "shared-prefix", "long-mix")  # what planner/sim/load.py builds


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible server under load: throughput, TTFT, TPOT, ITL, "
                                     "goodput (vLLM's serving benchmark)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server (http://HOST:PORT); default: start "
                                               "`atoll serve` on --model here with the engine flags below")
    p.add_argument("--model", default=None,
                   help="checkpoint dir the server serves (default: the demo model, SmolLM2-135M); its config "
                        "gives the vocabulary and the planner's shapes")
    p.add_argument("--scenario", choices=SCENARIOS, default="load",
                   help="load (default), long-prompt, routing (cache-aware against round-robin replicas), or "
                        "disagg (colocated against --prefill/--decode)")
    add_load_options(p)
    p.add_argument("--chaos", metavar="SPEC", default=None,
                   help="strike faults on the server's ranks during the load (kill@5:engine=1,stop@10:for=3,"
                        "slow@15:ms=50, random:n=3:seed=7) and report what they cost (bench/chaos_spec.py)")
    p.add_argument("--max-restarts", type=int, default=None, metavar="N",
                   help="--chaos: the server's restarts of one engine within its window before it stays down "
                        "(default the server's, 3 in 600 s; a soak that kills more often needs more)")
    p.add_argument("--compare-plan", action="store_true",
                   help="the planner's TTFT / TPOT for this model, layout, topology and load beside the measured")
    p.add_argument("--topology", default="local", help="--compare-plan: preset or YAML (default local; a "
                                                       "calibrated one from `atoll calibrate` is better)")
    p.add_argument("--no-speed-probe", dest="speed_probe", action="store_false",
                   help="--compare-plan: simulate with the calibration's steps as they are, without first timing "
                        "a probe of the machine's speed now (bench/serve_probe.py)")
    p.add_argument("--compare-offline", action="store_true",
                   help="first the same requests through LLM.generate here: output tokens/s of both and the ratio")
    p.add_argument("--rounds", type=int, default=1,
                   help="timed rounds of the load (with --compare-offline: of both, the order alternating; "
                        "medians compared) (default 1)")
    p.add_argument("--streams", type=int, default=8, help="long-prompt: requests decoding (default 8)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a round may take (default 900)")
    p.add_argument("--server-timeout", type=float, default=300.0,
                   help="seconds a started server may take to answer /health (default 300)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    engine = p.add_argument_group("engine flags, for the server started here (and --compare-offline)")
    add_model_options(engine, defaults=resolve())
    p.set_defaults(run=run)


def add_load_options(p) -> None:
    """The load's flags, which `atoll simulate` takes alike: one command line can be run or simulated."""
    p.add_argument("--num-prompts", type=int, default=50, help="requests (default 50)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 Poisson (default), lower burstier")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no cap)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per random request (default 128)")
    p.add_argument("--output-len", type=int, default=None,
                   help="output tokens per request (default 32; long-prompt streams 64)")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="random lengths uniform in len x [1 - r, 1 + r] (default 0: fixed)")
    p.add_argument("--prompts", choices=PROMPTS, default="random",
                   help="random ids (default); shared-prefix: each one of --system-prompts prompts of --input-len "
                        "ids, then --user-len ids of its own; long-mix: a --long-share of them --long-len ids")
    p.add_argument("--dataset", metavar="FILE.jsonl", default=None,
                   help='prompts instead of random ids: lines of {"prompt": text or ids, "output_len": N}')
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly the output length (ignore_eos and min_tokens; default on)")
    p.add_argument("--goodput", nargs="+", metavar="METRIC:MS", default=None,
                   help="SLOs: ttft:MS tpot:MS e2el:MS; reports attainment and goodput")
    p.add_argument("--metric-percentiles", default="50,90,99", help="percentiles reported (default 50,90,99)")
    p.add_argument("--seed", type=int, default=0, help="prompt and arrival seed (default 0)")
    p.add_argument("--long-len", type=int, default=4096,
                   help="long-prompt: its tokens; disagg: the long prompts' tokens (default 4096)")
    p.add_argument("--long-share", type=float, default=0.1,
                   help="disagg: the share of requests with --long-len tokens (default 0.1)")
    p.add_argument("--long-after", type=int, default=8,
                   help="long-prompt: sent once every stream has had this many chunks (default 8)")
    p.add_argument("--system-prompts", type=int, default=8,
                   help="routing: shared prompts of --input-len tokens the requests start with (default 8)")
    p.add_argument("--user-len", type=int, default=32,
                   help="routing: each request's own tokens after it; kv-tiers: each later turn's new tokens "
                        "(default 32)")
    p.add_argument("--turns", type=int, default=6, help="kv-tiers: turns of each conversation (default 6)")


MAX_PROMPTS = 10_000_000  # requests a load may hold (lengths bounded by the model's context)


def check_load(args) -> tuple[dict, tuple]:
    """The load flags' values (add_load_options), each out of range named in one line; the SLOs
    and percentiles parsed."""
    for name in ("num_prompts", "input_len", "long_len", "long_after", "system_prompts", "user_len"):
        v = getattr(args, name)
        if not 1 <= v <= MAX_PROMPTS:
            raise ConfigError(f"--{name.replace('_', '-')} {v} must be a whole number from 1 to {MAX_PROMPTS}")
    for name in ("output_len", "max_concurrency"):
        v = getattr(args, name)
        if v is not None and not 1 <= v <= MAX_PROMPTS:
            raise ConfigError(f"--{name.replace('_', '-')} {v} must be a whole number from 1 to {MAX_PROMPTS}")
    if not args.request_rate > 0:
        raise ConfigError(f"--request-rate {args.request_rate} must be positive (inf: all at once)")
    if not 0 < args.burstiness < math.inf:
        raise ConfigError(f"--burstiness {args.burstiness} must be a positive number")
    if not 0 <= args.long_share <= 1:
        raise ConfigError(f"--long-share {args.long_share} must lie in [0, 1]")
    return parse_goodput(args.goodput), parse_percentiles(args.metric_percentiles)


def check_args(args) -> tuple[dict, tuple]:
    for name in ("streams", "rounds"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
    for name in ("timeout", "server_timeout"):
        if not 0 < getattr(args, name) < math.inf:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} must be a positive number of seconds")
    return check_load(args)


def run(args) -> int:
    slos, percentiles = check_args(args)
    with Run(args.model, quiet=args.json) as bench:
        config = ModelConfig.load(bench.model)
        if args.chaos is not None:
            result = run_chaos(args, bench, bench.model, config.vocab_size)
            bench.emit({"model": bench.model, **result}, as_json=args.json, render=render_chaos)
            return 1 if result["requests_lost"] or result["texts_differing"] else 0
        if args.scenario == "long-prompt":
            result = run_long_prompt(args, bench, bench.model, config.vocab_size, percentiles)
            bench.emit({"model": bench.model, **result}, as_json=args.json, render=render_long)
            return 0
        if args.scenario == "disagg":
            result = run_disagg(args, bench, bench.model, config.vocab_size, slos, percentiles)
            bench.emit({"model": bench.model, **result}, as_json=args.json, render=render_disagg)
            return 1 if result["colocated"]["failed"] or result["disaggregated"]["failed"] else 0
        if args.scenario == "kv-tiers":
            result = run_tiers(args, bench, bench.model, config.vocab_size)
            bench.emit({"model": bench.model, **result}, as_json=args.json, render=render_tiers)
            return 1 if any(s["failed"] for s in result["sides"].values()) or not result["same_answers"] else 0
        if args.scenario == "routing":
            result = run_routing(args, bench, bench.model, config.vocab_size, percentiles)
            bench.emit({"model": bench.model, **result}, as_json=args.json, render=render_routing)
            return 1 if result["cache_aware"]["failed"] or result["round_robin"]["failed"] else 0
        result = run_load(args, bench, config, slos, percentiles)
    bench.emit(result, as_json=args.json, render=render)
    failed = result["serve"]["failed"]
    return 1 if failed else 0


WARM_SEED = 1_000_003  # the warm-up's prompts: none of a round's


def build_requests(args, config, *, seed: int, n: int | None = None):
    """--num-prompts requests (or n) of the --prompts kind from `seed`, else the --dataset's."""
    osl = args.output_len or 32
    n = n or args.num_prompts
    if args.dataset:
        return jsonl_requests(args.dataset, n, output_len=osl)
    vocab = config.vocab_size
    if args.prompts == "shared-prefix":
        return shared_prefix_requests(n, systems=args.system_prompts, system_len=args.input_len,
                                      user_len=args.user_len, output_len=osl, vocab_size=vocab, seed=seed)
    if args.prompts == "long-mix":
        return mixed_requests(n, input_len=args.input_len, long_len=args.long_len, long_share=args.long_share,
                              output_len=osl, vocab_size=vocab, seed=seed)
    return random_requests(n, input_len=args.input_len, output_len=osl, vocab_size=vocab,
                           seed=seed, range_ratio=args.range_ratio)


def run_load(args, bench, config, slos: dict, percentiles) -> dict:
    # each round its own prompts (both sides the same ones): a prompt sent again would be a prefix-cache hit
    rounds_requests = [build_requests(args, config, seed=args.seed + i) for i in range(args.rounds)]
    requests, warm = rounds_requests[0], build_requests(args, config, seed=args.seed + WARM_SEED, n=2)
    rate = "inf" if math.isinf(args.request_rate) else args.request_rate  # strict JSON has no Infinity
    out = {"model": bench.model, "num_prompts": len(requests), "request_rate": rate,
           "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
           "input_len": None if args.dataset else args.input_len, "output_len": args.output_len or 32,
           "dataset": args.dataset}
    probe = Probe.start(args, bench.model, config, requests)
    flags = probe.engine_flags if probe is not None else {}
    server = None if args.url else Server(bench.model, engine_argv(args, **flags), ready_timeout_s=args.server_timeout)
    with contextlib.ExitStack() as stack:
        if probe is not None:
            stack.callback(probe.close)
        offline = None
        if args.compare_offline:
            offline = stack.enter_context(Offline(args, bench.model, warm))
            out["offline_start_s"] = offline.start_s
        if server is not None:
            stack.enter_context(server)
        url = args.url or server.url
        model = served_model(url, bench.model)
        out |= {"url": args.url, "server_args": None if server is None else server.argv,
                "server_start_s": None if server is None else server.started_s, "served_model": model}
        warm_up(url, model, warm, args)
        if probe is not None:  # a second warm-up of the same shape, its ticks against the calibration's
            again = build_requests(args, config, seed=args.seed + PROBE_SEED, n=len(warm))
            probe.measure(lambda: warm_up(url, model, again, args))
        # the round's step cycles and rebalances, from the engines' own trace (bench/serve_cycles.py)
        cycles = Cycles(args.step_trace) if args.step_trace and server is not None else None
        metrics = lambda: scrape(url)  # noqa: E731
        spec0 = None
        if args.compare_plan and args.speculative_config:
            spec0 = spec_counts(url)
        reports, rounds = [], []
        for i in range(args.rounds):  # with --compare-offline: offline first in even rounds, the server in odd
            order = ("offline", "serve") if i % 2 == 0 or offline is None else ("serve", "offline")
            row = {"order": list(order) if offline is not None else ["serve"]}
            for side in order:
                if side == "offline" and offline is not None:
                    row["offline"] = offline.measure(rounds_requests[i])
                elif side == "serve":
                    cpu0, client0 = server.cpu() if server is not None else {}, time.process_time()
                    if i == 0 and probe is not None:
                        probe.round_start()
                    if i == 0 and cycles is not None:
                        cycles.round_start(metrics)
                    results, duration = asyncio.run(load(
                        url, model, rounds_requests[i], rate=args.request_rate, burstiness=args.burstiness,
                        max_concurrency=args.max_concurrency, seed=args.seed, ignore_eos=args.ignore_eos,
                        timeout_s=args.timeout))
                    reports.append(report(results, duration, slos=slos, percentiles=percentiles))
                    if i == 0 and probe is not None:
                        probe.round_end()
                    if i == 0 and cycles is not None:
                        cycles.round_end(metrics)
                        out["step_cycles"] = cycles.report()
                    if i == 0 and spec0 is not None:  # the simulator drafts as this round did
                        out["spec_measured"] = spec_rates(spec0, spec_counts(url), reports[0])
                    cpu = {"client": time.process_time() - client0}
                    cpu |= {k: v - cpu0[k] for k, v in (server.cpu() if server is not None else {}).items()}
                    row["serve_cpu_s"] = {k: round(v, 3) for k, v in cpu.items()}
                    row["serve_output_throughput"] = reports[-1]["output_throughput"]
            bench.note()
            rounds.append(row | {"load_avg_1m": round(bench.loads[-1], 2)})
    out["serve"] = reports[0]
    if args.rounds > 1:
        out["rounds"] = rounds
    if offline is not None:
        off = statistics.median(r["offline"]["output_throughput"] for r in rounds)
        on = statistics.median(r["serve_output_throughput"] or 0.0 for r in rounds)
        out["offline"] = rounds[0]["offline"] | {"median_output_throughput": off}
        out["serve_median_output_throughput"] = on
        out["serve_over_offline"] = sig(on / off, 4) if on and off else None
        for r in rounds:
            a, b = r["serve_output_throughput"], r["offline"]["output_throughput"]
            r["serve_over_offline"] = sig(a / b, 4) if a and b else None
        ratios = [r["serve_over_offline"] for r in rounds if r["serve_over_offline"]]
        out["serve_over_offline_median_of_rounds"] = sig(statistics.median(ratios), 4) if ratios else None
        if not math.isinf(args.request_rate) or args.max_concurrency:
            out["offline_note"] = "the server was not at saturation (a finite --request-rate or --max-concurrency)"
    if args.compare_plan:
        out["plan"] = compare_plan(args, bench.model, config, requests, out["serve"], slos=slos,
                                   percentiles=percentiles, spec=out.get("spec_measured"),
                                   speed=None if probe is None else probe.report())
    return out


def render(r: dict) -> str:
    s = r["serve"]
    rate = r["request_rate"] if r["request_rate"] == "inf" else f"{r['request_rate']:g}"
    lines = [f"{r['model']}: {r['num_prompts']} requests, {r['input_len'] or 'dataset'} in / {r['output_len']} out, "
             f"rate {rate} req/s, burstiness {r['burstiness']:g}, max concurrency {r['max_concurrency'] or '-'}",
             *report_lines(s)]
    for i, x in enumerate(r.get("rounds", [])):
        off = f", offline {_f(x['offline']['output_throughput'])}" if "offline" in x else ""
        ratio = f", server / offline {x['serve_over_offline']}" if "offline" in x else ""
        lines.append(f"  round {i + 1} ({', '.join(x['order'])}): server {_f(x['serve_output_throughput'])}{off} "
                     f"output tok/s{ratio}, load {x['load_avg_1m']}")
        cpu = [f"{k} {v:.1f}" for k, v in x["serve_cpu_s"].items()]
        cpu += [f"offline {k} {v:.1f}" for k, v in x.get("offline", {}).get("cpu_s", {}).items()]
        lines.append(f"    CPU s: {', '.join(cpu)}")
    if "offline" in r:
        o = r["offline"]
        lines.append(f"  offline LLM.generate: {_f(o['median_output_throughput'])} output tok/s, server "
                     f"{_f(r['serve_median_output_throughput'])} (medians over rounds); server / offline = "
                     f"{r['serve_over_offline']} (median of the rounds' ratios "
                     f"{r['serve_over_offline_median_of_rounds']})")
        if r.get("offline_note"):
            lines.append(f"  note: {r['offline_note']}")
    if "step_cycles" in r:
        lines += cycle_lines(r["step_cycles"])
    if "plan" in r:
        lines += plan_lines(r["plan"])
    for e in s.get("errors", []):
        lines.append(f"  error: {e}")
    return "\n".join(lines)
