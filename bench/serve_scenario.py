"""`atoll bench serve --scenario long-prompt`: what a long prompt arriving does to the streams
already decoding, with the default chunk budget and without chunking, side by side in one run.

--streams requests (default 8) of --input-len tokens start decoding --output-len tokens each;
once every one has streamed --long-after chunks, one prompt of --long-len tokens (default
4096) is sent for one token. Reported per side: the streams' ITL (mean, percentiles, max),
their mean TPOT, the long prompt's TTFT, and how many streams were still decoding when its
first token came (a stream that ended before saw no stall). Each side is its own server:
first the engine flags as given (the default --max-num-batched-tokens unless one is given),
then with a budget above the long prompt plus the streams (no chunking). Each server is
warmed by one short request and one long prompt, of other token ids, before the timed round.
"""

from __future__ import annotations

import asyncio
import math
import time

from atoll.bench.harness import sig
from atoll.bench.serve_load import payload, send, served_model, warm_up
from atoll.bench.serve_server import Server, engine_argv
from atoll.errors import ConfigError
from atoll.planner.sim.load import BenchRequest, random_requests
from atoll.planner.sim.report import RequestResult, report


async def long_prompt_round(url: str, model: str, streams: list[BenchRequest], long: BenchRequest, *,
                            after: int, ignore_eos: bool, timeout_s: float) -> dict:
    """The streams, then the long prompt once each stream has had `after` chunks."""
    # lazy: httpx is the optional atoll[serve]; atoll simulate imports this module without it
    import httpx

    endpoint = url.rstrip("/") + "/v1/completions"
    counts = [0] * len(streams)
    ready = asyncio.Event()

    def on_chunk(i: int):
        def seen(k: int) -> None:
            counts[i] = k
            if min(counts) >= after:
                ready.set()
        return seen

    limits = httpx.Limits(max_connections=len(streams) + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits) as client:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(asyncio.wait_for(
            send(client, endpoint, payload(model, s, ignore_eos=ignore_eos), prompt_len=s.prompt_len,
                 on_chunk=on_chunk(i)), timeout_s)) for i, s in enumerate(streams)]
        gate = asyncio.create_task(ready.wait())
        await asyncio.wait([gate, *tasks], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        gate.cancel()
        sent = time.perf_counter() - t0
        long_res = await asyncio.wait_for(send(client, endpoint, payload(model, long, ignore_eos=ignore_eos),
                                               prompt_len=long.prompt_len), timeout_s)
        results = []
        for t in tasks:
            try:
                results.append(await t)
            except asyncio.TimeoutError:
                results.append(RequestResult(error=f"timed out after {timeout_s:g} s"))
        duration = time.perf_counter() - t0
    first = sent + long_res.ttft  # the long prompt's first token, from the round's start
    return {"streams": results, "long": long_res, "long_sent_s": sent, "duration_s": duration,
            "streams_decoding_at_long_first_token": sum(
                1 for r in results if r.success and r.start + r.latency > first and long_res.success),
            "gated": ready.is_set()}


def side(round_: dict, *, budget: int, percentiles) -> dict:
    streams, long = round_["streams"], round_["long"]
    rep = report(streams, round_["duration_s"], percentiles=percentiles)
    gaps = [g for r in streams if r.success for g in r.itl]
    return {"max_num_batched_tokens": budget, "chunks_of_long_prompt": math.ceil(long.prompt_tokens / budget)
            if long.prompt_tokens else None,
            "streams_completed": rep["completed"], "itl_ms": rep["itl_ms"] | {"max": max(gaps) * 1e3 if gaps else None},
            "tpot_ms": rep["tpot_ms"], "long_prompt": {"prompt_tokens": long.prompt_tokens, "ttft_ms": long.ttft * 1e3
                                                       if long.success else None, "error": long.error or None},
            "long_sent_s": round_["long_sent_s"],
            "streams_decoding_at_long_first_token": round_["streams_decoding_at_long_first_token"],
            "errors": sorted({r.error for r in streams if r.error})[:3] or None}


def run_long_prompt(args, bench, model_dir: str, vocab_size: int, percentiles) -> dict:
    """Both sides (module docstring), each on a server of its own."""
    from atoll.launch.api import llm_from_args as make_llm  # lazy: torch; as in serve_compare.Offline

    if args.url:
        raise ConfigError("--scenario long-prompt starts its own servers (one per chunk budget): drop --url")
    osl = args.output_len or 64
    llm = make_llm(args, model_dir)  # no ranks: the budget and context `atoll serve` takes from the same flags
    mml, default_budget = llm.max_model_len, llm.max_num_batched_tokens
    if args.long_len + 1 > mml or args.input_len + osl > mml:
        raise ConfigError(f"--long-len {args.long_len}: the context is {mml} tokens (max_model_len)")
    streams = random_requests(args.streams, input_len=args.input_len, output_len=osl, vocab_size=vocab_size,
                              seed=args.seed)
    long, warm_long = random_requests(2, input_len=args.long_len, output_len=1, vocab_size=vocab_size,
                                      seed=args.seed + 1)
    warm_short = random_requests(1, input_len=args.input_len, output_len=osl, vocab_size=vocab_size,
                                 seed=args.seed + 2)[0]  # no stream's prompt: it would be cached
    no_chunk = args.long_len + args.streams  # the long prompt and a token of each stream in one step
    sides = {}
    for name, budget, argv in (("default", default_budget, engine_argv(args)),
                               ("no_chunking", no_chunk, engine_argv(args, max_num_batched_tokens=no_chunk))):
        with Server(model_dir, argv, ready_timeout_s=args.server_timeout) as url:
            model = served_model(url, model_dir)
            warm_up(url, model, [warm_short, warm_long], args)
            r = asyncio.run(long_prompt_round(url, model, streams, long, after=args.long_after,
                                              ignore_eos=args.ignore_eos, timeout_s=args.timeout))
        bench.note()
        sides[name] = side(r, budget=budget, percentiles=percentiles) | {"server_args": argv}
    d, n = sides["default"]["itl_ms"], sides["no_chunking"]["itl_ms"]
    p = f"p{percentiles[-1]:g}".replace(".", "_")

    def ratio(a, b):
        return sig(a / b, 4) if a and b else None

    out = {"scenario": "long-prompt", "streams": args.streams, "input_len": args.input_len, "output_len": osl,
           "long_len": args.long_len, "long_after_chunks": args.long_after, "default": sides["default"],
           "no_chunking": sides["no_chunking"],
           "ratio_no_chunking_over_default": {f"itl_{p}": ratio(n[p], d[p]), "itl_max": ratio(n["max"], d["max"])}}
    if default_budget >= args.long_len:
        out["note"] = (f"the default budget ({default_budget} tokens) already holds the {args.long_len}-token "
                       "prompt: both sides prefill it in one step")
    return out


def render(r: dict) -> str:
    lines = [f"long prompt of {r['long_len']} tokens sent while {r['streams']} streams decode "
             f"({r['input_len']} in, {r['output_len']} out; after {r['long_after_chunks']} chunks each)"]
    keys = [k for k in r["default"]["itl_ms"] if k != "mean"]
    lines.append(f"{'':<14}{'budget':>8}{'chunks':>8}" + "".join(f"{'ITL ' + k:>12}" for k in ["mean", *keys])
                 + f"{'TPOT mean':>12}{'long TTFT':>12}{'still dec.':>11}")
    for name in ("default", "no_chunking"):
        s = r[name]
        fmt = [s["itl_ms"][k] for k in ["mean", *keys]]
        lines.append(f"{name:<14}{s['max_num_batched_tokens']:>8}{s['chunks_of_long_prompt'] or '-':>8}"
                     + "".join(f"{_ms(v):>12}" for v in fmt) + f"{_ms(s['tpot_ms']['mean']):>12}"
                     + f"{_ms(s['long_prompt']['ttft_ms']):>12}{s['streams_decoding_at_long_first_token']:>11}")
    ratios = ", ".join(f"{k} {v}x" for k, v in r["ratio_no_chunking_over_default"].items())
    lines.append(f"no chunking / default: {ratios}")
    if r.get("note"):
        lines.append(f"note: {r['note']}")
    return "\n".join(lines)


def _ms(v) -> str:
    return "-" if v is None else f"{v:.1f} ms"

