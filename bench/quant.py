"""atoll bench --quantization METHOD: the same requests through the unquantized model and the
quantized one, side by side in one run on the same ranks.

Each rank builds both runners once (the checkpoint's weights in --dtype, and the same with
--quantization), each with its compiled decode step (engine.step.compiled; --enforce-eager: eager
both), then every round runs the requests through both, the order alternating, and reads the
1-minute load average after it. Warm-up rounds are untimed (the first compiles both steps).
tokens/s = batch x output-len / end-to-end time (prefill + decode); decode step = the median
TPOT; the ratio is the median of the per-round ratios, their range beside it. Weight bytes:
what a decode step reads (bench.model_rank.decode_weight_bytes, int8 weights and their scales
as stored). Same tokens: greedy positions where the two runs' tokens agree, last round.
"""

from __future__ import annotations

import os
import statistics

import torch
from rich.console import Console
from rich.table import Table

from atoll.bench.harness import sig
from atoll.bench.model_rank import decode_weight_bytes, time_atoll
from atoll.engine.rank.runner import ModelRunner
from atoll.launch.local import run_local
from atoll.models import quantize
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ParallelContext


def run(args, bench, cfg: dict, llm, spec, requests) -> int:
    """The side-by-side run on llm's layout (bench.model.run has prepared it)."""
    quantize.check(args.quantization, llm.config, args.device)
    world = llm.layout.world_size
    threads = args.threads or max(1, bench.cores // world)
    policy = "never" if args.enforce_eager else "always"
    spec = spec.with_engine(compile=policy, quantization=None)
    cfg = cfg | {"model": bench.model, "layout": str(llm.layout), "quantization": args.quantization,
                 "threads_per_rank": threads, "ranks": world, "path": "eager" if args.enforce_eager else "compiled"}
    result = run_local(_rank, world, cfg, spec, requests, threads=threads, timeout_s=3600,
                       device=spec.engine.device)[0]
    bench.emit(result, as_json=args.json, render=render, more_loads=result["load_avg_rounds"])
    return 0


def _rank(rank: int, world: int, cfg: dict, spec, requests, device: str = "cpu") -> dict | None:
    layout = Layout.parse(spec.layout)
    ctx = ParallelContext.create(layout, rank, device) if world > 1 else ParallelContext.single(device)
    sides = {"base": ModelRunner(spec, ctx),
             "quant": ModelRunner(spec.with_engine(quantization=cfg["quantization"]), ctx)}
    dev = sides["base"].device
    weights = {k: float(ctx.world.all_reduce(torch.tensor([_read_bytes(r.model, cfg["batch"])], dtype=torch.float64,
                                                          device=dev))) for k, r in sides.items()}
    rounds, loads = [], []
    for i in range(cfg["warmup"] + cfg["rounds"]):
        ctx.world.barrier()
        order = ["base", "quant"] if i % 2 == 0 else ["quant", "base"]
        got = {k: time_atoll(sides[k], requests) for k in order}
        if i >= cfg["warmup"] and rank == 0:
            rounds.append(got)
            loads.append(os.getloadavg()[0])
    if rank != 0:
        return None
    dtype = str(sides["base"].dtype).removeprefix("torch.")
    result = summarize(cfg | {"dtype": dtype}, rounds, weights)
    result["load_avg_rounds"] = [round(x, 2) for x in loads]
    result["compiled"] = {k: r.decode_step is not None for k, r in sides.items()}
    return result


def _read_bytes(model, batch: int) -> int:
    """Weight bytes a decode step reads, the int8 weights' scales included."""
    scales = sum(t.numel() * t.element_size() for n, t in model.named_buffers() if n.endswith("weight_scale"))
    return decode_weight_bytes(model, batch) + scales


def summarize(cfg: dict, rounds: list, weights: dict) -> dict:
    med = statistics.median

    def side(k: str) -> dict:
        runs = [r[k] for r in rounds]
        total, tokens = med(r["total_s"] for r in runs), sum(runs[0]["tokens"])
        return {"total_s": sig(total), "output_tokens": tokens, "tokens_per_s": sig(tokens / total),
                "prefill_s": sig(med(r["prefill_s"] for r in runs)),
                "decode_step_s": sig(med(r["decode_step_s"] for r in runs)),
                "decode_weight_bytes": int(weights[k])}

    ratios = [r["base"]["total_s"] / r["quant"]["total_s"] for r in rounds]
    steps = [r["base"]["decode_step_s"] / r["quant"]["decode_step_s"] for r in rounds]
    last = rounds[-1]
    pairs = [(a, b) for x, y in zip(last["base"]["token_ids"], last["quant"]["token_ids"]) for a, b in zip(x, y)]
    return {"config": cfg, "base": side("base"), "quant": side("quant"),
            "tokens_per_s_ratio": sig(med(ratios)), "tokens_per_s_ratio_range": [sig(min(ratios)), sig(max(ratios))],
            "decode_step_ratio": sig(med(steps)), "decode_step_ratio_range": [sig(min(steps)), sig(max(steps))],
            "same_tokens": sum(a == b for a, b in pairs), "tokens": len(pairs)}


def render(r: dict) -> None:
    c, b, q = r["config"], r["base"], r["quant"]
    t = Table(title=f"{os.path.basename(c['model'].rstrip('/'))} {c['layout']} {c['path']}: batch {c['batch']}, "
                    f"{c['input_len']} in, {c['output_len']} out; median of {c['rounds']} rounds")
    for col in ("measure", c["dtype"], f"--quantization {c['quantization']}", "ratio (median; min - max)"):
        t.add_column(col, justify="left" if col == "measure" else "right")
    ms = lambda s: f"{s * 1e3:.1f} ms"  # noqa: E731
    lo, hi = r["tokens_per_s_ratio_range"]
    t.add_row("tokens/s", f"{b['tokens_per_s']:.1f}", f"{q['tokens_per_s']:.1f}",
              f"{r['tokens_per_s_ratio']:.2f}x ({lo:.2f} - {hi:.2f})")
    lo, hi = r["decode_step_ratio_range"]
    t.add_row("decode step", ms(b["decode_step_s"]), ms(q["decode_step_s"]),
              f"{r['decode_step_ratio']:.2f}x ({lo:.2f} - {hi:.2f})")
    t.add_row("prefill (time to first token)", ms(b["prefill_s"]), ms(q["prefill_s"]), "")
    t.add_row("weights read per decode step", f"{b['decode_weight_bytes'] / 2**20:.1f} MiB",
              f"{q['decode_weight_bytes'] / 2**20:.1f} MiB", f"{b['decode_weight_bytes'] / q['decode_weight_bytes']:.2f}x")
    t.add_row("same greedy tokens (last round)", "", f"{r['same_tokens']}/{r['tokens']}", "")
    t.add_row("threads", f"{c['ranks']} x {c['threads_per_rank']}", "", "")
    t.add_row("load average 1 min (start, end; highest after a round)",
              ", ".join(map(str, r["load_avg_1m"])) + f"; {max(r['load_avg_rounds'], default=0):.2f}", "", "")
    Console().print(t)
    print(f"--quantization {c['quantization']} vs {c['dtype']}: {r['tokens_per_s_ratio']:.2f}x tokens/s, "
          f"{r['decode_step_ratio']:.2f}x decode step")
