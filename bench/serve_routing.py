"""`atoll bench serve --scenario routing`: cache-aware routing by the engines' cache events,
the same rule over the router's own model of what it sent (sent_prefix), and round-robin, over
the same replicas (--data-parallel-size N, a dense model), side by side in one run.

--system-prompts prompts (default 8) of --input-len random token ids (512 in the manual's
figure) are shared: each of --num-prompts requests is one of them, drawn at random, followed
by --user-len random ids of its own, generating --output-len tokens. Each router gets a server
of its own (the same engine flags plus --router), warmed by two requests of other ids, then
the same requests at --request-rate (default: all at once). Reported per side: the prefix
hit rate the engines measured (prompt tokens served from their caches / prompt tokens, from
/metrics over the round), the hit rate the router expected, how the requests were routed,
TTFT and E2EL (mean, percentiles), throughput, and the load average after the side.
"""

from __future__ import annotations

import asyncio

from atoll.bench.harness import sig
from atoll.bench.serve_load import run_load, served_model, warm_up
from atoll.bench.serve_server import Server, engine_argv
from atoll.errors import ConfigError
from atoll.planner.sim.load import random_requests, shared_prefix_requests
from atoll.planner.sim.report import report

ROUTERS = ("cache_aware", "sent_prefix", "round_robin")


def scrape(url: str) -> dict[str, float]:
    """/metrics' samples: name (with its labels) -> value."""
    # lazy: httpx is the optional atoll[serve]; atoll simulate imports this module without it
    import httpx

    out = {}
    for line in httpx.get(url.rstrip("/") + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def server_round(args, model_dir: str, argv: list[str], requests, warm) -> tuple[list, float, dict, dict]:
    """One server of `argv` (started here, ended after): warmed by `warm`, then `requests` at
    the bench's rate; (results, duration, /metrics before, /metrics after)."""
    with Server(model_dir, argv, ready_timeout_s=args.server_timeout) as url:
        model = served_model(url, model_dir)
        warm_up(url, model, warm, args)
        before = scrape(url)
        results, duration = asyncio.run(run_load(
            url, model, requests, rate=args.request_rate, burstiness=args.burstiness,
            max_concurrency=args.max_concurrency, seed=args.seed, ignore_eos=args.ignore_eos,
            timeout_s=args.timeout))
        return results, duration, before, scrape(url)


def side(before: dict, after: dict, rep: dict, *, models_cache: bool) -> dict:
    """One router's figures over the round (the metrics' differences); models_cache: the
    router keeps a model of the caches (round-robin expects nothing)."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    prompt, cached = delta("atoll_prompt_tokens_total"), delta("atoll_prompt_tokens_cached_total")
    routed_prompt, expected = delta("atoll_router_prompt_tokens_total"), delta("atoll_router_prefix_hit_tokens_total")
    routes: dict[str, int] = {}
    for name in after:
        if name.startswith("atoll_router_requests_total{"):
            reason = name.split('reason="')[1].split('"')[0]
            routes[reason] = routes.get(reason, 0) + int(delta(name))
    per_replica: dict[str, int] = {}
    for name in after:
        if name.startswith("atoll_router_requests_total{"):
            replica = name.split('replica="')[1].split('"')[0]
            per_replica[replica] = per_replica.get(replica, 0) + int(delta(name))
    return {"prefix_hit_rate": sig(cached / prompt, 4) if prompt else None,
            "router_expected_hit_rate": sig(expected / routed_prompt, 4) if routed_prompt and models_cache else None,
            "prompt_tokens": int(prompt), "cached_tokens": int(cached), "routes": routes,
            "requests_per_replica": dict(sorted(per_replica.items())),
            "completed": rep["completed"], "failed": rep["failed"], "duration_s": round(rep["duration_s"], 3),
            "ttft_ms": rep["ttft_ms"], "e2el_ms": rep["e2el_ms"], "output_throughput": rep["output_throughput"],
            "errors": rep.get("errors")}


def run_routing(args, bench, model_dir: str, vocab_size: int, percentiles) -> dict:
    """Both routers (module docstring), each on a server of its own."""
    if args.url:
        raise ConfigError("--scenario routing starts its own servers (one per router): drop --url")
    if not args.data_parallel_size or args.data_parallel_size < 2:
        raise ConfigError("--scenario routing needs replicas: give --data-parallel-size N (N >= 2)")
    if args.system_prompts < 1 or args.user_len < 1:
        raise ConfigError("--system-prompts and --user-len must be at least 1")
    osl = args.output_len or 16
    requests = shared_prefix_requests(args.num_prompts, systems=args.system_prompts, system_len=args.input_len,
                                      user_len=args.user_len, output_len=osl, vocab_size=vocab_size, seed=args.seed)
    warm = random_requests(2, input_len=args.user_len, output_len=osl, vocab_size=vocab_size, seed=args.seed + 7)
    sides = {}
    for router in ROUTERS:
        argv = engine_argv(args) + ["--router", router]
        results, duration, before, after = server_round(args, model_dir, argv, requests, warm)
        bench.note()
        rep = report(results, duration, percentiles=percentiles)
        sides[router] = side(before, after, rep, models_cache=router != "round_robin") | {"load_avg_1m_after": round(bench.loads[-1], 2),
                                                    "server_args": argv}
    ca, rr = sides["cache_aware"], sides["round_robin"]
    p50 = lambda s: s["ttft_ms"].get("p50")  # noqa: E731
    return {"scenario": "routing", "replicas": args.data_parallel_size, "num_prompts": len(requests),
            "system_prompts": args.system_prompts, "system_len": args.input_len, "user_len": args.user_len,
            "output_len": osl, "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
            **sides,
            "ttft_p50_round_robin_over_cache_aware": sig(p50(rr) / p50(ca), 4) if p50(rr) and p50(ca) else None}


def render(r: dict) -> str:
    lines = [f"{r['model']}: {r['replicas']} replicas, {r['num_prompts']} requests over {r['system_prompts']} "
             f"system prompts of {r['system_len']} tokens + {r['user_len']} own, {r['output_len']} out, "
             f"rate {r['request_rate']} req/s"]
    lines.append(f"{'router':<13}{'hit rate':>9}{'expected':>9}{'TTFT p50':>10}{'TTFT mean':>10}{'E2EL p50':>10}"
                 f"{'out tok/s':>10}{'done':>6}{'load':>6}  routes / per replica")
    for name in (n for n in ROUTERS if n in r):
        s = r[name]
        routes = " ".join(f"{k} {v}" for k, v in sorted(s["routes"].items()))
        per = "/".join(str(v) for v in s["requests_per_replica"].values())
        lines.append(f"{name:<13}{_f(s['prefix_hit_rate'], 3):>9}{_f(s['router_expected_hit_rate'], 3):>9}"
                     f"{_f(s['ttft_ms'].get('p50'), 0):>10}{_f(s['ttft_ms'].get('mean'), 0):>10}"
                     f"{_f(s['e2el_ms'].get('p50'), 0):>10}{_f(s['output_throughput'], 1):>10}{s['completed']:>6}"
                     f"{s['load_avg_1m_after']:>6}  {routes}; {per}")
        for e in s.get("errors") or []:
            lines.append(f"  error: {e}")
    lines.append(f"TTFT p50 round_robin / cache_aware: {r['ttft_p50_round_robin_over_cache_aware']}")
    return "\n".join(lines)


def _f(v, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"
