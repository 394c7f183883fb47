"""atoll bench tbo: two-batch overlap (TBO) off and on, the step time at several token counts,
side by side in one run on the same ranks.

The model (--model, or by default the DeepSeek-V3-shaped model of random weights that
`atoll bench eplb` builds, unskewed: --experts routed experts, top --topk, MLA) runs at
--layout (default EP2) with --enable-two-batch-overlap. For each count N of --tokens, two kinds
of step: a prefill of --seqs prompts of N / --seqs tokens each (one step of N tokens), and a
decode of N sequences (steps of N rows; --decode-steps of them a run, the median taken). Each is
run --repeat times with TBO off and on in turn (the threshold switched between runs, so both
sides see the same ranks, caches and load), after one untimed run of each; per side the median
of the runs' step times, and off / on (above 1: TBO faster). The crossover is the smallest N
from which TBO is faster, by more than 5%, at every larger N measured. The tokens of every
run must be the same. The 1-minute load average is read around each count; the ranks share the machine's cores out
(torch threads = cores / ranks).
"""

from __future__ import annotations

import os
import statistics

import torch

from atoll.bench.eplb import skewed_moe
from atoll.bench.harness import Run, load_avg
from atoll.config import default_cache_dir
from atoll.engine.rank.loop import run_batch
from atoll.engine.rank.runner import ModelRunner
from atoll.engine.sample.sampler import SamplingParams
from atoll.errors import ConfigError
from atoll.launch.api import LLM
from atoll.launch.local import run_local
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ParallelContext

OFF = 10**9  # a threshold no step reaches
MARGIN = 1.05  # faster means by more than this: runs on a shared machine spread about as much


def add_parser(sub) -> None:
    p = sub.add_parser("tbo", help="MoE two-batch overlap off vs on: step time by tokens per step, the crossover",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="an MoE checkpoint (default: a DeepSeek-V3-shaped random model)")
    p.add_argument("--layout", default="EP2", help="an EP layout (default EP2; DP2EP2: DP attention over EP2)")
    p.add_argument("--tokens", default="16,32,64,128,256,512",
                   help="tokens per step to measure, comma-separated (default 16,32,64,128,256,512)")
    p.add_argument("--seqs", type=int, default=8, help="prompts in a prefill step (default 8)")
    p.add_argument("--decode-steps", type=int, default=4, help="decode steps a run (default 4)")
    p.add_argument("--experts", type=int, default=16, help="default model: routed experts (default 16)")
    p.add_argument("--topk", type=int, default=4, help="default model: experts per token (default 4)")
    p.add_argument("--hidden", type=int, default=256, help="default model: hidden size (default 256)")
    p.add_argument("--inter", type=int, default=512,
                   help="default model: each expert's intermediate size (default 512)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per side and count (default 3)")
    p.add_argument("--moe-exchange", default="auto", choices=["auto", "alltoall", "gather"],
                   help="MoE exchange (default auto, the engine's)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=run)


def counts(text: str, seqs: int) -> list[int]:
    try:
        ns = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ConfigError(f"--tokens {text!r} is not a list of whole numbers") from None
    if not ns or any(n < max(2, seqs) or n % seqs for n in ns):
        raise ConfigError(f"--tokens {text!r}: each count must be a multiple of --seqs {seqs}, at least 2")
    return sorted(ns)


def run(args) -> int:
    for name in ("seqs", "decode_steps", "experts", "topk", "hidden", "inter", "repeat"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} must be positive")
    ns = counts(args.tokens, args.seqs)
    layout = Layout.parse(args.layout)
    if layout.ep < 2:
        raise ConfigError(f"--layout {args.layout} has no expert parallelism: TBO overlaps the EP exchange")
    name = f"dsv3-e{args.experts}-k{args.topk}-s0.0-f0-h{args.hidden}-i{args.inter}"
    model = args.model or str(skewed_moe(default_cache_dir() / "bench-eplb" / name, experts=args.experts,
                                         topk=args.topk, skew=0.0, hidden_size=args.hidden,
                                         moe_intermediate_size=args.inter))
    with Run(model, needs_model=False) as bench:
        llm = LLM(model, layout=args.layout, enable_two_batch_overlap=True, tbo_token_threshold=2,
                  enable_prefix_caching=False, moe_exchange=args.moe_exchange, max_num_seqs=max(ns),
                  max_num_batched_tokens=4 * max(ns), compile="never")
        gen = torch.Generator().manual_seed(0)
        vocab = llm.config.vocab_size
        cases = []
        for n in ns:
            prefill = [torch.randint(1, vocab, (n // args.seqs,), generator=gen).tolist() for _ in range(args.seqs)]
            decode = [torch.randint(1, vocab, (4,), generator=gen).tolist() for _ in range(n)]
            cases.append((n, llm.prepare(prefill, SamplingParams(max_tokens=1, ignore_eos=True)),
                          llm.prepare(decode, SamplingParams(max_tokens=1 + args.decode_steps, ignore_eos=True))))
        spec = llm.spec([r for _, p, d in cases for r in p + d])
        threads = max(1, (os.cpu_count() or 1) // layout.world_size)
        ranks = run_local(sides, layout.world_size, spec, cases, args.repeat, timeout_s=1800, threads=threads)
    result = ranks[0] | {"config": {"layout": args.layout, "seqs": args.seqs, "decode_steps": args.decode_steps,
                                    "repeat": args.repeat, "moe_exchange": args.moe_exchange, "model": model,
                                    "threads": threads}}
    result["crossover"] = {kind: crossover(result["rows"], kind) for kind in ("prefill", "decode")}
    bench.emit(result, as_json=args.json, render=render, more_loads=[x for r in ranks for x in r["loads"]])
    return 0 if result["same_tokens"] else 1


def sides(rank: int, world: int, spec, cases, repeat: int) -> dict:
    """One rank: per token count, prefill and decode runs with TBO off and on in turn."""
    runner = ModelRunner(spec, ParallelContext.create(Layout.parse(spec.layout), rank))
    tbo = runner.two_batch
    rows, tokens, loads, same = [], {}, [], True
    for n, prefill, decode in cases:
        loads.append(load_avg())
        row = {"tokens": n}
        for kind, requests in (("prefill", prefill), ("decode", decode)):
            times = {"off": [], "on": []}
            for i in range(repeat + 1):
                for side in ("off", "on"):
                    tbo.threshold = OFF if side == "off" else 2
                    trace: list = []
                    split = runner.stats.get("two_batch", 0)
                    results = run_batch(runner, requests, trace=trace)
                    steps = [s for shape, s, *_ in trace if whole(shape, kind, n // runner.ctx.layout.dp)]
                    if not steps:
                        raise RuntimeError(f"no {kind} step of {n} tokens alone in the run")
                    if side == "on" and runner.stats.get("two_batch", 0) == split:
                        raise RuntimeError(f"TBO on: no step of {n} tokens split")
                    got = [r["token_ids"] for r in results] if results and results[0] is not None else None
                    same &= tokens.setdefault((n, kind), got) == got
                    if i:  # the first run of each side is untimed
                        times[side].append(statistics.median(steps))
            off, on = statistics.median(times["off"]), statistics.median(times["on"])
            row[kind] = {"off_s": off, "on_s": on, "speedup": off / on}
        rows.append(row)
    loads.append(load_avg())
    return {"rows": rows, "same_tokens": same, "loads": loads}


def whole(shape, kind: str, n: int) -> bool:
    """Whether a traced step is the case's: a prefill of n prompt tokens alone, or a decode of
    n rows alone (a replica's share under DP)."""
    return (shape.chunk_tokens, shape.rows) == ((n, 0) if kind == "prefill" else (0, n))


def crossover(rows: list[dict], kind: str) -> int | None:
    """The smallest token count from which TBO is faster (by MARGIN) at every larger one measured (None: never)."""
    at = None
    for row in reversed(rows):
        if row[kind]["speedup"] <= MARGIN:
            break
        at = row["tokens"]
    return at


def render(result: dict) -> None:
    cfg = result["config"]
    print(f"{cfg['layout']}, exchange {cfg['moe_exchange']}, {cfg['threads']} torch threads a rank; "
          f"prefill: {cfg['seqs']} prompts a step; decode: one row per sequence; {cfg['model']}")
    print(f"{'tokens':>7} {'prefill off':>12} {'on':>9} {'off/on':>7} {'decode off':>12} {'on':>9} {'off/on':>7}")
    for row in result["rows"]:
        p, d = row["prefill"], row["decode"]
        print(f"{row['tokens']:>7} {p['off_s'] * 1e3:>9.1f} ms {p['on_s'] * 1e3:>6.1f} ms {p['speedup']:>7.2f} "
              f"{d['off_s'] * 1e3:>9.1f} ms {d['on_s'] * 1e3:>6.1f} ms {d['speedup']:>7.2f}")
    for kind, at in result["crossover"].items():
        print(f"{kind}: TBO faster (by > 5%) from {at} tokens a step on" if at else
              f"{kind}: TBO not faster (by > 5%) at any count")
    print(f"median of {cfg['repeat']} runs a side; tokens {'identical' if result['same_tokens'] else 'DIFFER'} "
          f"off and on; load average (1 min) {result['load_avg_1m'][0]:.2f} before, "
          f"{result['load_avg_1m'][-1]:.2f} after, on {result['cores']} cores")
