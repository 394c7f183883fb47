"""atoll bench prefix: the same requests with prefix caching off and on, side by side in one run
on the same ranks.

--requests prompts (default 64) share one --system-len-token system prompt (default 512)
followed by --unique-len tokens of their own (default 16), random token ids from --seed; all
arrive at once and generate --output-len tokens each (ignore_eos, greedy). The ranks are
spawned once and build the runner once; each round runs the requests with caching off and
on (the order alternating between rounds), each run starting from an empty cache, after one
untimed run of two requests. Reported,
medians over --rounds: prefill tokens computed (prompt tokens less those found cached), the
median TTFT, the run's total time, the hit rate (cached / prompt tokens), and whether the
tokens are identical. With caching, the first request computes the system prompt and the
others admitted with it or later share its blocks (under PP, once per lane: each lane's pool
has its own cache).
The decode step runs eagerly on both sides (no torch.compile warm-up): the bench is about
prefill. The 1-minute load average is read before and after.
"""

from __future__ import annotations

import statistics
import time

import torch

from atoll.bench.harness import Run
from atoll.engine.rank.loop import run_batch
from atoll.engine.rank.runner import ModelRunner
from atoll.engine.sample.sampler import SamplingParams
from atoll.errors import ConfigError
from atoll.launch.api import LLM
from atoll.launch.local import run_local
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ParallelContext


def add_parser(sub) -> None:
    p = sub.add_parser("prefix", help="prefix caching off vs on: prefill tokens computed and TTFT",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: the demo model, SmolLM2-135M)")
    p.add_argument("--layout", default="TP1", help="atoll layout (default TP1)")
    p.add_argument("--requests", type=int, default=64, help="requests (default 64)")
    p.add_argument("--system-len", type=int, default=512, help="tokens of the shared system prompt (default 512)")
    p.add_argument("--unique-len", type=int, default=16, help="tokens of each request's own part (default 16)")
    p.add_argument("--output-len", type=int, default=8, help="generated tokens per request (default 8)")
    p.add_argument("--rounds", type=int, default=1, help="rounds, each running off and on (default 1)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="sequences per micro-batch (default 32)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=run)


def run(args) -> int:
    for name in ("requests", "system_len", "unique_len", "output_len", "rounds", "max_num_seqs"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
    with Run(args.model, quiet=args.json) as bench:
        args.model = bench.model
        llm, spec, requests = prepare(args)
        if llm.layout.dp > 1:
            raise ConfigError(f"layout {llm.layout}: the prefix bench runs layouts without dp")
        result = run_local(_rank, llm.layout.world_size, spec, requests, args.rounds, timeout_s=3600,
                           device=spec.engine.device)[0]
    result |= {"model": args.model, "layout": str(llm.layout), "requests": args.requests,
               "system_len": args.system_len, "unique_len": args.unique_len, "output_len": args.output_len,
               "rounds": args.rounds}
    bench.emit(result, as_json=args.json, render=render)
    return 0


def prepare(args):
    """(LLM, RunSpec, requests): the shared system prompt plus each request's own tokens."""
    length = args.system_len + args.unique_len + args.output_len
    llm = LLM(args.model, layout=args.layout, max_num_seqs=args.max_num_seqs, max_model_len=length,
              enforce_eager=True)
    if llm.max_model_len < length:
        raise ConfigError(f"--system-len + --unique-len + --output-len = {length} exceeds the model's context "
                          f"{llm.config.max_position_embeddings}")
    gen = torch.Generator().manual_seed(args.seed)
    system = torch.randint(0, llm.config.vocab_size, (args.system_len,), generator=gen).tolist()
    own = torch.randint(0, llm.config.vocab_size, (args.requests, args.unique_len), generator=gen).tolist()
    requests = llm.prepare([system + o for o in own], SamplingParams(max_tokens=args.output_len, ignore_eos=True))
    return llm, llm.spec(requests).with_engine(enable_prefix_caching=True), requests


def _rank(rank: int, world: int, spec, requests, rounds: int, device: str = "cpu") -> dict | None:
    layout = Layout.parse(spec.layout)
    ctx = ParallelContext.create(layout, rank, device) if world > 1 else ParallelContext.single(device)
    runner = ModelRunner(spec, ctx)
    run_batch(runner, requests[:2])  # untimed: the first forward pays for allocation
    runs = {False: [], True: []}
    for i in range(rounds):
        for caching in ((False, True) if i % 2 == 0 else (True, False)):
            runner.spec = spec.with_engine(enable_prefix_caching=caching)
            ctx.world.barrier()
            runs[caching].append(measure(runner, requests))
    runner.spec = spec
    if rank != 0:
        return None
    return {"device": str(runner.device), "dtype": str(runner.dtype).removeprefix("torch."),
            "off": summarize(runs[False]), "on": summarize(runs[True]),
            "tokens_identical": all(r["token_ids"] == runs[False][0]["token_ids"] for r in runs[False] + runs[True])}


def measure(runner, requests) -> dict:
    t0 = time.perf_counter()
    results = run_batch(runner, requests)
    total = time.perf_counter() - t0
    m = [r["metrics"] for r in results]
    prompt, cached = sum(x["prompt_tokens"] for x in m), sum(x["cached_tokens"] for x in m)
    return {"total_s": total, "ttft_s": statistics.median(x["ttft_s"] for x in m), "prompt_tokens": prompt,
            "prefill_tokens": prompt - cached, "hit_rate": cached / prompt,
            "preemptions": sum(x["preemptions"] for x in m), "token_ids": [r["token_ids"] for r in results]}


def summarize(runs: list[dict]) -> dict:
    """Medians over the rounds (token counts are the same every round)."""
    out = {k: statistics.median(r[k] for r in runs) for k in ("total_s", "ttft_s")}
    return out | {k: runs[0][k] for k in ("prompt_tokens", "prefill_tokens", "hit_rate", "preemptions")}


def render(r: dict) -> str:
    off, on = r["off"], r["on"]
    lines = [f"atoll bench prefix: {r['requests']} requests, a {r['system_len']}-token shared system prompt + "
             f"{r['unique_len']} own tokens, {r['output_len']} output tokens; {r['layout']} on {r['device']} "
             f"({r['dtype']}), {r['rounds']} round(s)",
             f"{'':24}{'caching off':>14}{'caching on':>14}{'on / off':>10}"]
    for name, key, fmt in (("prefill tokens computed", "prefill_tokens", "{:.0f}"),
                           ("TTFT median (s)", "ttft_s", "{:.3f}"), ("total (s)", "total_s", "{:.2f}")):
        ratio = on[key] / off[key] if off[key] else float("nan")
        lines.append(f"{name:24}{fmt.format(off[key]):>14}{fmt.format(on[key]):>14}{ratio:>10.3f}")
    lines.append(f"{'hit rate':24}{off['hit_rate']:>14.1%}{on['hit_rate']:>14.1%}")
    lines.append(f"{'preemptions':24}{off['preemptions']:>14}{on['preemptions']:>14}")
    lines.append(f"tokens identical: {'yes' if r['tokens_identical'] else 'NO'}; load average (1 min) "
                 f"{r['load_avg_1m'][0]} before, {r['load_avg_1m'][1]} after, on {r['cores']} cores")
    return "\n".join(lines)
