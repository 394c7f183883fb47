"""atoll bench eplb: expert load balancing (EPLB) before and after a rebalance, side by side
in one run on the same ranks.

The model (--model, or by default `skewed_moe`: a DeepSeek-V3-shaped model of random
weights, --experts routed experts, top --topk, whose router's score-correction bias favours
a quarter of them by --skew: the experts the initial placement puts on rank 1, so the round
before shows the skew on one rank; built once with transformers under the cache directory)
runs at --ep ranks with --enable-eplb and --redundant spare slots. Round "before": the
initial placement (contiguous blocks, the spare slots copying experts 0..R-1). Then one
rebalance from that round's counted load, every layer moved before the next step (timed).
Round "after": the same requests again. Each round runs them --repeat times, prefix caching
off so every run computes the same prompts; an untimed run comes first (allocations,
first-call costs). Per round: each MoE layer's max/mean tokens per ep rank and its tokens per
rank, the MoE dispatch bytes each rank sent (the all_to_all's, which follow the placement:
--moe-exchange alltoall by default; the decode-sized gather exchange moves the same bytes
whatever the placement), the median prefill and decode step and a run's wall time; the
tokens of the two rounds must be the same. The 1-minute load average is read around each
round. The ranks share the machine's cores out (torch threads = cores / --ep).

--under-load N: rebalancing under load instead. --repeat rounds, each running the requests
three ways on the same ranks: no rebalance, a rebalance every N steps whose layers move one a
step with their copies in the background (the default), and the same with every layer moved
at the rebalance's step boundary (--no-eplb-async). Reported per way: the median and the
longest decode step cycle (from one step's end to the next's, so the work between steps,
where layers switch, counts), and the layers moved; the tokens of every run must be the same.
"""

from __future__ import annotations

import os
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from atoll.bench.harness import Run, load_avg
from atoll.comm.eplb import Placement
from atoll.config import default_cache_dir
from atoll.engine.rank.loop import run_batch
from atoll.engine.rank.runner import ModelRunner
from atoll.engine.sample.sampler import SamplingParams
from atoll.errors import ConfigError
from atoll.launch.api import LLM
from atoll.launch.local import run_local
from atoll.parallel import links
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ParallelContext


def add_parser(sub) -> None:
    p = sub.add_parser("eplb", help="MoE expert load balancing: load, dispatch bytes and step time before and "
                                    "after a rebalance", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="an MoE checkpoint (default: the skewed DeepSeek-V3-shaped model)")
    p.add_argument("--ep", type=int, default=4, help="expert-parallel ranks (layout EP<n>; default 4)")
    p.add_argument("--redundant", type=int, default=4, help="redundant expert slots (default 4)")
    p.add_argument("--experts", type=int, default=16, help="default model: routed experts (default 16)")
    p.add_argument("--topk", type=int, default=4, help="default model: experts per token (default 4)")
    p.add_argument("--skew", type=float, default=0.4,
                   help="default model: score-correction bias of a quarter of the experts (default 0.4)")
    p.add_argument("--hidden", type=int, default=SHAPE["hidden_size"],
                   help=f"default model: hidden size (default {SHAPE['hidden_size']})")
    p.add_argument("--inter", type=int, default=SHAPE["moe_intermediate_size"],
                   help=f"default model: each expert's intermediate size (default {SHAPE['moe_intermediate_size']})")
    p.add_argument("--prompts", type=int, default=8, help="requests, run together (default 8)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens each (default 64)")
    p.add_argument("--output-len", type=int, default=16, help="tokens generated each (default 16)")
    p.add_argument("--repeat", type=int, default=3, help="runs of the requests per round (default 3)")
    p.add_argument("--moe-exchange", default="alltoall", choices=["auto", "alltoall", "gather"],
                   help="MoE exchange (default alltoall: its bytes follow the placement)")
    p.add_argument("--under-load", type=int, default=None, metavar="N",
                   help="instead: --repeat rounds of the requests run with no rebalance, with a rebalance every N "
                        "steps whose copies run in the background (one layer a step), and with every layer moved at "
                        "the rebalance's step boundary; each side's longest decode step cycle against its median")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=run)


# the default model's shape: large enough that the experts' work shows in a CPU step
SHAPE = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=4, first_k_dense_replace=1, n_shared_experts=1, n_group=1,
             topk_group=1, kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
             max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.1)


def skewed_moe(out_dir, *, experts: int = 16, topk: int = 4, skew: float = 0.4, first: int = 0, seed: int = 0,
               **shape) -> Path:
    """A DeepSeek-V3 of random weights whose every router adds `skew` to the scores of a
    quarter of its experts, `first` on, when choosing (e_score_correction_bias, as the V3
    checkpoints carry it), saved with save_pretrained: those experts take most tokens. Made
    once per arguments."""
    from transformers import AutoConfig, AutoModelForCausalLM  # lazy: transformers is for this model only

    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    config = AutoConfig.for_model("deepseek_v3", **{**SHAPE, **shape, "n_routed_experts": experts,
                                                    "num_experts_per_tok": topk})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers[config.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias[first:first + experts // 4] = skew
    model.save_pretrained(out, safe_serialization=True)
    return out


def run(args) -> int:
    for name in ("ep", "experts", "topk", "prompts", "prompt_len", "output_len", "repeat", "hidden", "inter"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} must be positive")
    if args.redundant < 0:
        raise ConfigError(f"--redundant {args.redundant} must be 0 or more")
    first = Placement.initial(args.experts, args.redundant, args.ep).local(min(1, args.ep - 1))[0]
    name = f"dsv3-e{args.experts}-k{args.topk}-s{args.skew}-f{first}-h{args.hidden}-i{args.inter}"
    model = args.model or str(skewed_moe(default_cache_dir() / "bench-eplb" / name, experts=args.experts,
                                         topk=args.topk, skew=args.skew, first=first, hidden_size=args.hidden,
                                         moe_intermediate_size=args.inter))
    with Run(model, needs_model=False) as bench:
        llm = LLM(model, layout=f"EP{args.ep}", enable_eplb=True, num_redundant_experts=args.redundant,
                  eplb_step_interval=10**9, expert_load_interval=0, enable_prefix_caching=False,
                  moe_exchange=args.moe_exchange, max_num_seqs=args.prompts, compile="never")
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, llm.config.vocab_size, (args.prompt_len,), generator=gen).tolist()
                   for _ in range(args.prompts)]
        requests = llm.prepare(prompts, SamplingParams(max_tokens=args.output_len, ignore_eos=True))
        side = rounds if args.under_load is None else partial(under_load, interval=args.under_load)
        threads = max(1, (os.cpu_count() or 1) // args.ep)  # the cores shared out, not oversubscribed
        ranks = run_local(side, args.ep, llm.spec(requests), requests, args.repeat, timeout_s=900, threads=threads)
    keys = ("ep", "redundant", "prompts", "prompt_len", "output_len", "repeat", "moe_exchange", "under_load",
            "hidden", "inter")
    result = ranks[0] | {"config": {k: getattr(args, k) for k in keys} | {"model": model}}
    bench.emit(result, as_json=args.json, render=render if args.under_load is None else render_load,
               more_loads=[x for r in ranks for x in r["loads"]])
    return 0 if result["same_tokens"] else 1


def rounds(rank: int, world: int, spec, requests, repeat: int = 1) -> dict:
    """One rank of the bench: an untimed round, the round before, a rebalance, the round after
    (rank 0 returns the load reports; every rank its dispatch bytes, times and tokens)."""
    ctx = ParallelContext.create(Layout.parse(spec.layout), rank)
    runner = ModelRunner(spec, ctx)
    balancer = runner.balancer
    out, tokens, loads = {}, [], []
    run_batch(runner, requests)  # untimed: first-call costs
    for name in ("before", "after"):
        if name == "after":
            t0, moved = time.perf_counter(), balancer.layers_moved
            balancer.rebalance(now=True)
            out["rebalance_s"], out["layers_moved"] = time.perf_counter() - t0, balancer.layers_moved - moved
        balancer.reset()
        links.reset(ctx, runner.model)
        loads.append(load_avg())
        trace: list = []
        t0 = time.perf_counter()
        for _ in range(repeat):  # the window counts every repeat; the steps are timed in each
            results = run_batch(runner, requests, trace=trace)
        wall = (time.perf_counter() - t0) / repeat
        report = balancer.measure()
        sent = sum(sum(m.dispatcher.bytes.values()) + sum(m.exchange_bytes.values()) for m in runner.model.moe_layers)
        per_rank = ctx.ep.all_gather(torch.tensor([sent]), dim=0).tolist()
        prefill = [s for shape, s, *_ in trace if shape.chunk_tokens]
        decode = [s for shape, s, *_ in trace if not shape.chunk_tokens]
        out[name] = {"load": report, "dispatch_bytes": per_rank, "wall_s": wall,
                     "prefill_step_s": statistics.median(prefill) if prefill else None,
                     "decode_step_s": statistics.median(decode) if decode else None}
        tokens.append([r["token_ids"] for r in results])
    loads.append(load_avg())
    return out | {"same_tokens": tokens[0] == tokens[1], "tokens": tokens[0], "loads": loads}


class Stamps(list):
    """A step trace (EngineCore's) that keeps when each step ended: the gaps between two are
    whole step cycles, the work between steps (a rebalance's moves) included."""

    def append(self, entry) -> None:
        super().append((*entry, time.perf_counter()))


def under_load(rank: int, world: int, spec, requests, repeat: int, *, interval: int) -> dict:
    """One rank of --under-load: an untimed run, then --repeat rounds of the requests run with
    rebalancing off, on with the copies in the background, and on with every layer moved at
    once (each round in that order, on the same ranks); rank 0's decode step cycles of each."""
    ctx = ParallelContext.create(Layout.parse(spec.layout), rank)
    runner = ModelRunner(spec, ctx)
    balancer = runner.balancer
    run_batch(runner, requests)
    modes = ("off", "async", "sync")
    cycles, moved, tokens, loads = {m: [] for m in modes}, dict.fromkeys(modes, 0), [], []
    for _ in range(repeat):
        for mode in modes:
            balancer.eplb, balancer.background, balancer.interval = mode != "off", mode == "async", interval
            before, trace = balancer.layers_moved, Stamps()
            loads.append(load_avg())
            results = run_batch(runner, requests, trace=trace)
            cycles[mode] += [b[-1] - a[-1] for a, b in zip(trace, trace[1:]) if not b[0].chunk_tokens]
            moved[mode] += balancer.layers_moved - before
            tokens.append([r["token_ids"] for r in results])
    out = {m: {"median_step_s": statistics.median(cycles[m]), "longest_step_s": max(cycles[m]),
               "steps": len(cycles[m]), "layers_moved": moved[m]} for m in modes}
    return out | {"same_tokens": all(t == tokens[0] for t in tokens), "tokens": tokens[0], "loads": loads}


def render_load(result: dict) -> None:
    cfg = result["config"]
    print(f"EP{cfg['ep']}, {cfg['redundant']} redundant slots, a rebalance every {cfg['under_load']} steps; "
          f"{cfg['prompts']} prompts of {cfg['prompt_len']} tokens + {cfg['output_len']} generated")
    print(f"{'rebalancing':>24} {'median step':>12} {'longest':>9} {'longest/median':>15} {'layers moved':>13}")
    for mode, label in (("off", "off"), ("async", "a layer a step (async)"), ("sync", "all at once (sync)")):
        r = result[mode]
        print(f"{label:>24} {r['median_step_s'] * 1e3:>9.1f} ms {r['longest_step_s'] * 1e3:>6.1f} ms "
              f"{r['longest_step_s'] / r['median_step_s']:>15.2f} {r['layers_moved']:>13}")
    print(f"{cfg['repeat']} rounds of each; tokens {'identical' if result['same_tokens'] else 'DIFFER'} in every run; "
          f"load average (1 min) "
          f"{result['load_avg_1m'][0]:.2f} before, {result['load_avg_1m'][-1]:.2f} after, on {result['cores']} cores")


def render(result: dict) -> None:
    cfg, before, after = result["config"], result["before"], result["after"]
    print(f"EP{cfg['ep']}, {cfg['redundant']} redundant slots, {cfg['prompts']} prompts of {cfg['prompt_len']} "
          f"tokens + {cfg['output_len']} generated, exchange {cfg['moe_exchange']}; {cfg['model']}")
    print(f"{'layer':>5} {'max/mean before':>16} {'after':>6}   tokens per rank before -> after")
    for layer, b in before["load"]["layers"].items():
        a = after["load"]["layers"][layer]
        print(f"{layer:>5} {b['max_mean']:>16.2f} {a['max_mean']:>6.2f}   {b['tokens']} -> {a['tokens']}")
    mib = lambda xs: ", ".join(f"{x / 2**20:.2f}" for x in xs)  # noqa: E731
    print(f"dispatch MiB per rank: before [{mib(before['dispatch_bytes'])}], after [{mib(after['dispatch_bytes'])}]")
    for key, label in (("prefill_step_s", "prefill step"), ("decode_step_s", "decode step"), ("wall_s", "run")):
        b, a = before[key], after[key]
        if b and a:
            print(f"{label:>12}: {b * 1e3:8.1f} ms before, {a * 1e3:8.1f} ms after ({b / a:.2f}x)")
    print(f"rebalance: {result['layers_moved']} layers moved in {result['rebalance_s'] * 1e3:.0f} ms; "
          f"tokens {'identical' if result['same_tokens'] else 'DIFFER'} in both rounds")
    print(f"load average (1 min) {result['load_avg_1m'][0]:.2f} before, {result['load_avg_1m'][-1]:.2f} after, "
          f"on {result['cores']} cores")
