"""`atoll bench serve --scenario disagg`: colocated against disaggregated serving of the same
requests, side by side in one run.

--num-prompts requests at --request-rate (Poisson, --burstiness): each has --input-len random
token ids, except a --long-share of them (default 0.1, drawn at random) with --long-len; each
generates --output-len tokens. The colocated side is a server of the layout flags given
(--layout, -tp/-pp/...; default TP1); the disaggregated side a server of --prefill/--decode
(with --prefill-replicas, --decode-replicas, --disagg-min-prompt-tokens,
--disagg-max-prefill-queue as given). Each server is warmed by two requests of other ids.
Reported per side: TTFT, TPOT, ITL and E2EL (mean and percentiles), throughput, goodput
under --goodput, for the disaggregated side how many requests took each path (its /metrics),
and the load average after the side. Give both sides the same ranks for a fair comparison
(e.g. -pp 2 against --prefill TP1 --decode TP1).
"""

from __future__ import annotations

from atoll.bench.harness import sig
from atoll.bench.serve_routing import server_round
from atoll.bench.serve_server import engine_argv
from atoll.errors import ConfigError
from atoll.planner.sim.load import mixed_requests, random_requests
from atoll.planner.sim.report import report

SIDES = ("colocated", "disaggregated")


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """argv less the given flags (each with its value)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        out.append(a)
    return out


DISAGG_FLAGS = ("--prefill", "--decode", "--prefill-replicas", "--decode-replicas", "--disagg-min-prompt-tokens",
                "--disagg-max-prefill-queue", "--colocated-replicas")
LAYOUT_FLAGS = ("--layout", "--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size",
                "--expert-parallel-size")


def run_disagg(args, bench, model_dir: str, vocab_size: int, slos: dict, percentiles) -> dict:
    if args.url:
        raise ConfigError("--scenario disagg starts its own servers (colocated, then disaggregated): drop --url")
    if not args.prefill or not args.decode:
        raise ConfigError("--scenario disagg needs --prefill and --decode (the disaggregated side's layouts)")
    if not 0 <= args.long_share <= 1:
        raise ConfigError(f"--long-share {args.long_share} must be in [0, 1]")
    osl = args.output_len or 32
    requests = mixed_requests(args.num_prompts, input_len=args.input_len, long_len=args.long_len,
                              long_share=args.long_share, output_len=osl, vocab_size=vocab_size, seed=args.seed)
    warm = random_requests(2, input_len=args.input_len, output_len=4, vocab_size=vocab_size, seed=args.seed + 7)
    full = engine_argv(args)
    argvs = {"colocated": _without(full, DISAGG_FLAGS), "disaggregated": _without(full, LAYOUT_FLAGS)}
    sides = {}
    for name in SIDES:
        results, duration, before, after = server_round(args, model_dir, argvs[name], requests, warm)
        bench.note()
        rep = report(results, duration, slos=slos, percentiles=percentiles)
        paths = {p: int(after.get(f'atoll_disagg_requests_total{{path="{p}"}}', 0)
                        - before.get(f'atoll_disagg_requests_total{{path="{p}"}}', 0)) for p in ("prefill", "decode")}
        sides[name] = rep | {"paths": paths if name == "disaggregated" else None, "server_args": argvs[name],
                             "load_avg_1m_after": round(bench.loads[-1], 2)}
    long = sum(r.prompt_len == args.long_len for r in requests)
    c, d = sides["colocated"], sides["disaggregated"]
    return {"scenario": "disagg", "num_prompts": len(requests), "long_prompts": long, "input_len": args.input_len,
            "long_len": args.long_len, "output_len": osl,
            "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
            "colocated": c, "disaggregated": d,
            "goodput_disagg_over_colocated": _ratio(d, c, "request_goodput"),
            "ttft_p50_disagg_over_colocated": _ratio(d, c, "p50", "ttft_ms"),
            "tpot_p50_disagg_over_colocated": _ratio(d, c, "p50", "tpot_ms")}


def _ratio(a: dict, b: dict, key: str, group: str | None = None):
    x = (a.get(group) or {}).get(key) if group else (a.get("goodput") or {}).get(key)
    y = (b.get(group) or {}).get(key) if group else (b.get("goodput") or {}).get(key)
    return sig(x / y, 4) if x and y else None


def render(r: dict) -> str:
    lines = [f"{r['model']}: {r['num_prompts']} requests ({r['long_prompts']} of {r['long_len']} tokens, the rest "
             f"{r['input_len']}), {r['output_len']} out, rate {r['request_rate']} req/s"]
    lines.append(f"{'side':<15}{'TTFT p50':>9}{'TTFT p99':>9}{'TPOT p50':>9}{'TPOT p99':>9}{'ITL p99':>9}"
                 f"{'E2EL p50':>9}{'out tok/s':>10}{'attain':>7}{'goodput':>8}{'done':>5}{'load':>6}  paths")
    for name in SIDES:
        s = r[name]
        g = s.get("goodput") or {}
        paths = " ".join(f"{k} {v}" for k, v in (s["paths"] or {}).items()) or "-"
        lines.append(f"{name:<15}{_f(s['ttft_ms'].get('p50')):>9}{_f(s['ttft_ms'].get('p99')):>9}"
                     f"{_f(s['tpot_ms'].get('p50')):>9}{_f(s['tpot_ms'].get('p99')):>9}{_f(s['itl_ms'].get('p99')):>9}"
                     f"{_f(s['e2el_ms'].get('p50')):>9}{_f(s['output_throughput'], 1):>10}"
                     f"{_f(g.get('attainment'), 3):>7}{_f(g.get('request_goodput'), 3):>8}{s['completed']:>5}"
                     f"{s['load_avg_1m_after']:>6}  {paths}")
        for e in s.get("errors") or []:
            lines.append(f"  error: {e}")
    lines.append(f"ms; goodput in req/s. disaggregated / colocated: goodput {r['goodput_disagg_over_colocated']}, "
                 f"TTFT p50 {r['ttft_p50_disagg_over_colocated']}, TPOT p50 {r['tpot_p50_disagg_over_colocated']}")
    return "\n".join(lines)


def _f(v, digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f}"
