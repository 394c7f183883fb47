"""A shifting load, sent to several deployments of the same ranks in turn: short prompts for one
half, then a mix with --long-share of prompts of --long-len tokens for the other, Poisson at one
rate. For each deployment: goodput and latency per half, and what its autoscaler decided (when,
which engine, why), read from GET /admin/autoscale. Every request of every side is the same.

    python examples/make_random_checkpoint.py /tmp/tiny8k --shape tiny-8k --device cpu --dtype float32
    python examples/shifting_load.py --model /tmp/tiny8k --half-s 300 --rate 1.2 --goodput ttft:2000 tpot:100 \\
        --side "autoscale=--prefill TP1 --decode TP1 --prefill-replicas 1 --decode-replicas 3 --autoscale" \\
        --side "1P1D + 2 colocated=--prefill TP1 --decode TP1 --prefill-replicas 1 --decode-replicas 3 \\
            --colocated-replicas 2" \\
        --side "4 replicas=-dp 4"

A side is `NAME=FLAGS` (`atoll serve`'s flags; --goodput is added to a side with --autoscale).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time

from atoll.bench.harness import load_avg
from atoll.bench.serve_load import run_load, served_model, warm_up
from atoll.bench.serve_server import Server
from atoll.models.config import ModelConfig
from atoll.planner.sim.load import mixed_requests, random_requests
from atoll.planner.sim.report import num, parse_goodput, report


def parse_side(text: str) -> tuple[str, list[str]]:
    name, sep, flags = text.partition("=")
    if not sep or not name.strip():
        raise SystemExit(f"--side {text!r}: expected NAME=FLAGS")
    return name.strip(), shlex.split(flags)


def build(args, vocab: int) -> tuple[list, int]:
    """The requests in the order they are sent, and how many the first (short) half holds."""
    n = max(1, round(args.rate * args.half_s))
    short = random_requests(n, input_len=args.input_len, output_len=args.output_len, vocab_size=vocab,
                            seed=args.seed, range_ratio=args.range_ratio)
    mixed = mixed_requests(n, input_len=args.input_len, long_len=args.long_len, long_share=args.long_share,
                           output_len=args.output_len, vocab_size=vocab, seed=args.seed + 1)
    return short + mixed, n


def halves(results: list, first: int, duration: float, slos: dict) -> list[dict]:
    """The report of each half: the first from the first send to the first mixed request's send,
    the second from there to the end."""
    cut = results[first].start if first < len(results) else duration
    return [report(results[:first], cut, slos=slos), report(results[first:], duration - cut, slos=slos)]


def get(url: str, path: str):
    import httpx

    try:
        r = httpx.get(url + path, timeout=10.0)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def run_side(args, name: str, flags: list[str], requests: list, first: int, slos: dict, vocab: int) -> dict:
    if "--autoscale" in flags and "--goodput" not in flags:
        flags = flags + ["--goodput", *args.goodput, "--autoscale-interval-s", str(args.autoscale_interval_s)]
    print(f"atoll: {name}: starting atoll serve {' '.join(flags)}", file=sys.stderr)
    with Server(args.model, flags, ready_timeout_s=args.server_timeout) as url:
        model = served_model(url, args.model)
        warm = mixed_requests(2, input_len=args.input_len, long_len=args.long_len, long_share=0.5,
                              output_len=args.output_len, vocab_size=vocab, seed=args.seed + 1_000_003)
        warm_up(url, model, warm, argparse.Namespace(ignore_eos=True, timeout=args.timeout))
        load0, t0 = load_avg(), time.time()
        results, duration = asyncio.run(run_load(url, model, requests, rate=args.rate, seed=args.seed,
                                                 timeout_s=args.timeout))
        decisions = (get(url, "/admin/autoscale") or {}).get("data", [])
        out = {"side": name, "flags": flags, "load_avg_1m": [round(load0, 2), round(load_avg(), 2)],
               "started": t0, "halves": halves(results, first, duration, slos), "decisions": decisions}
    return out


def lines(r: dict) -> list[str]:
    out = [f"{r['side']}: atoll serve {' '.join(r['flags'])} (load {r['load_avg_1m'][0]}-{r['load_avg_1m'][1]})"]
    for label, h in zip(("short prompts", "long mix"), r["halves"]):
        g = h.get("goodput", {})
        out.append(f"  {label:<14} {h['completed']:>4}/{h['requests']:<4} goodput {num(g.get('request_goodput'))} req/s "
                   f"(attainment {num(g.get('attainment'), 3)}), TTFT p50 {num(h['ttft_ms']['p50'], 0)} "
                   f"p90 {num(h['ttft_ms']['p90'], 0)} ms, TPOT p50 {num(h['tpot_ms']['p50'], 0)} "
                   f"p90 {num(h['tpot_ms']['p90'], 0)} ms, failed {h['failed']}")
    for d in r["decisions"]:
        engine = "" if d["engine"] is None else f" (engine {d['engine']})"
        threshold = "" if d["threshold"] is None else f" -> {d['threshold']} tokens"
        out.append(f"  at {d['at'] - r['started']:.0f} s: {d['action']} {d['role']}{engine}{threshold}"
                   f"{'' if d['applied'] else ' [not applied]'}: {d['reason']}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--side", action="append", required=True, help="NAME=FLAGS (repeat)")
    p.add_argument("--half-s", type=float, default=300.0)
    p.add_argument("--rate", type=float, default=2.0)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--long-len", type=int, default=4096)
    p.add_argument("--long-share", type=float, default=0.5)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--goodput", nargs="+", default=["ttft:2000", "tpot:200"])
    p.add_argument("--autoscale-interval-s", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--server-timeout", type=float, default=600.0)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    slos = parse_goodput(args.goodput)
    sides = [parse_side(s) for s in args.side]
    vocab = ModelConfig.load(args.model).vocab_size
    requests, first = build(args, vocab)
    results = []
    for name, flags in sides:
        results.append(run_side(args, name, flags, requests, first, slos, vocab))
        print("\n".join(lines(results[-1])), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
