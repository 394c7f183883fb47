"""atoll bench: atoll's generate loop against transformers' `generate` on the same model, and
atoll's decode step against the memory-bandwidth floor of this machine, in one run.

A fixed batch of equal-length random-token prompts (no padding) generates exactly
--output-len tokens per sequence on both sides: atoll with ignore_eos, transformers greedy
with min_new_tokens = max_new_tokens. Both run on the rank's device (--device, bound by the
launcher: launch/device.py) in the same dtype (--dtype; default as the runtime: the
checkpoint's torch_dtype on CUDA, float32 on CPU). The ranks are spawned once; inside them
the runner and the transformers model are built, then every round times atoll's
`run_requests` with the compiled decode step (engine.compiled) and with the eager one, then
transformers' `generate` (on rank 0, the other ranks wait at a barrier) and a large tensor
copy, alternating which side goes first. The closing lines report the default path: compiled,
unless --enforce-eager (or ATOLL_ENFORCE_EAGER=1, or a model the step does not compile) leaves
eager only. Warm-up rounds are untimed; the first one compiles the buckets the run uses (on a
2-core CPU ~40 s for SmolLM2, printed on stderr). Figures are medians over the timed rounds
(default 5); each round pairs an atoll run with a transformers run, and vs transformers is the
median of those per-round ratios, with their range as the spread (compiled vs eager likewise).
The 1-minute load average is read before, after each round and after: when it passes the
core count after a round or at the end, a warning says the figures were taken on a shared
machine (the bench's own ranks and transformers keep it near the core count). On CUDA
every timed region ends with a synchronize before the clock is read. atoll's KV cache holds
what the batch needs (as on CPU), not a share of GPU memory, so transformers' copy of the
model fits beside it.

vs transformers = atoll tokens/s / transformers tokens/s, tokens/s = batch x output-len /
end-to-end time (prefill + decode). Threads: each atoll rank gets --threads (default: cores
/ ranks), transformers and the copy get --threads x ranks, so both sides use the same count.

of bandwidth floor = floor / atoll's decode step, floor = weight bytes a decode step reads /
copy bandwidth. Weight bytes: every parameter of every rank except the embedding table, of
which only the batch's rows are read (the LM head is counted, tied or not); the KV cache is
not counted. Copy bandwidth: `dst.copy_(src)` of --copy-mib MiB on the rank's device,
counting read + write (2 x the tensor's bytes per copy, as STREAM's Copy does); on CUDA each
timed region repeats it enough times to hide the launch and synchronize. A read-only bandwidth (summing
both tensors, which together outsize the last-level cache) is reported beside it, with the
fraction it gives, since weights are only read. A decode step is the time between
a sequence's first and last token over the tokens in between (TPOT), loop overhead included.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from atoll.calibrate.timing import sync
from atoll.config import DEVICES, DTYPES
from atoll.errors import ConfigError


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="checkpoint dir (default: the demo model, SmolLM2-135M)")
    p.add_argument("--layout", default="TP1", help="atoll layout (default TP1)")
    p.add_argument("--device", default="auto", choices=DEVICES,
                   help="auto: CUDA when every rank sees a GPU, else CPU (default auto)")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="both sides' dtype (default: the checkpoint's torch_dtype on CUDA, float32 on CPU)")
    p.add_argument("--batch", type=int, default=16, help="sequences (default 16)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per sequence (default 128)")
    p.add_argument("--output-len", type=int, default=64, help="generated tokens per sequence (default 64)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per atoll rank (default cores / ranks)")
    p.add_argument("--copy-mib", type=int, default=256, help="tensor copied to measure bandwidth (default 256)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="atoll's eager decode step only: no torch.compile (default: compiled and eager side by side)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def add_parser(sub) -> None:
    p = sub.add_parser("model", help="atoll vs transformers generate, decode vs bandwidth floor (the default)",
                       description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.set_defaults(run=run)


def check(args) -> dict:
    """The options as a plain dict for the ranks; one clear line for each bad one."""
    for name in ("batch", "input_len", "rounds", "copy_mib"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} must be positive")
    if args.output_len < 2:
        raise ConfigError(f"--output-len {args.output_len}: a decode step needs at least 2 output tokens")
    if args.warmup < 0 or (args.threads is not None and args.threads < 1):
        raise ConfigError("--warmup must be >= 0 and --threads >= 1")
    return {k: getattr(args, k) for k in ("batch", "input_len", "output_len", "rounds", "warmup",
                                           "copy_mib", "seed", "enforce_eager")}


def run(args) -> int:
    from atoll.launch.local import run_local

    cfg = check(args)
    if args.model is None:
        from atoll.models.gguf import demo_model_dir

        args.model = str(demo_model_dir(progress=not args.json))
    llm, spec, requests = prepare(args.model, args.layout, batch=cfg["batch"], input_len=cfg["input_len"],
                                  output_len=cfg["output_len"], seed=cfg["seed"], device=args.device,
                                  dtype=args.dtype, enforce_eager=args.enforce_eager)
    if llm.layout.dp > 1:
        raise ConfigError(f"layout {llm.layout}: the model bench runs layouts without dp")
    world = llm.layout.world_size
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    cfg |= {"model": str(args.model), "layout": str(llm.layout),
            "threads": {"atoll_per_rank": threads, "ranks": world, "transformers": threads * world}}
    load = os.getloadavg()[0]
    result = run_local(_rank, world, cfg, spec, requests, threads=threads, timeout_s=3600, device=spec.engine.device)[0]
    result["load_avg_1m"] = [round(load, 2), round(os.getloadavg()[0], 2)]
    cores = os.cpu_count() or 1
    # after each round and at the end (the figure at the start mostly tells what ran before)
    peak = max(result["load_avg_1m"][1:] + result["load_avg_rounds"])
    if peak > cores:
        result["load_warning"] = (f"the 1-minute load average reached {peak:.1f} on {cores} cores during the run: "
                                  "other work shared the machine, so these figures understate both sides")
        print(f"atoll bench: warning: {result['load_warning']}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        render(result)
    return 0


def prepare(model, layout, *, batch: int, input_len: int, output_len: int, seed: int = 0, device: str = "auto",
            dtype: str | None = None, enforce_eager: bool = False):
    """(LLM, RunSpec, requests): `batch` random-token prompts of `input_len` tokens, each to
    generate exactly `output_len` tokens, and a KV cache of what they need."""
    from dataclasses import replace

    import torch

    from atoll.engine.kv_sizing import cpu_blocks
    from atoll.launch.api import LLM
    from atoll.engine.sampling import SamplingParams

    B, L, N = batch, input_len, output_len
    llm = LLM(model, layout=layout, device=device, dtype=dtype, max_num_seqs=B, max_model_len=L + N,
              enforce_eager=enforce_eager)
    if llm.max_model_len < L + N:
        raise ConfigError(f"--input-len + --output-len = {L + N} exceeds the model's context "
                          f"{llm.config.max_position_embeddings}")
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, llm.config.vocab_size, (B, L), generator=gen).tolist()
    requests = llm.prepare(prompts, SamplingParams(max_tokens=N, ignore_eos=True))
    # the cache the batch needs in every pipeline lane, on every device: on CUDA a share of
    # GPU memory would leave no room for transformers' copy of the model
    blocks = cpu_blocks(block_size=llm.block_size, max_num_seqs=B, max_model_len=L + N, lanes=llm.layout.pp)
    return llm, replace(llm.spec(), num_blocks=blocks), requests


def decode_weight_bytes(model, batch: int) -> int:
    """Parameter bytes one decode step of `batch` sequences reads on this rank."""
    from atoll.layers.embedding import ParallelLMHead, VocabParallelEmbedding

    # a tied LM head shares the embedding's tensor: read whole by the head
    embed = ({id(m.weight) for m in model.modules() if isinstance(m, VocabParallelEmbedding)}
             - {id(m.weight) for m in model.modules() if isinstance(m, ParallelLMHead)})
    total = 0
    for p in model.parameters():
        if id(p) in embed:
            total += min(batch, p.shape[0]) * p[0].numel() * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def time_atoll(runner, requests, pipelined: bool = True) -> dict:
    import torch

    from atoll.engine.generate import run_requests

    sync(runner.device)
    t0 = time.perf_counter()
    results = run_requests(runner, requests, pipelined=pipelined)  # syncs each step (.tolist())
    total = time.perf_counter() - t0
    # each rank's share of the run spent computing; the rest waits for activations or tokens
    busy = runner.ctx.world.all_gather(
        torch.tensor([runner.stats["busy"]], dtype=torch.float64, device=runner.device), dim=0)
    return {"total_s": total, "busy": busy.tolist(), "tokens": [len(r["token_ids"]) for r in results],
            "prefill_s": statistics.median(r["metrics"]["ttft_s"] for r in results),
            "decode_step_s": statistics.median(r["metrics"]["tpot_s"] for r in results),
            "token_ids": [r["token_ids"] for r in results]}


def _time_transformers(model, input_ids, n: int) -> dict:
    import torch
    from transformers import LogitsProcessorList

    stamps, device = [], input_ids.device

    def stamp(ids, scores):  # called once per generated token, after its forward
        sync(device)  # generate syncs each step anyway (its stopping check)
        stamps.append(time.perf_counter())
        return scores

    eos = model.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, list) else eos
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, pad_token_id=pad,
                             logits_processor=LogitsProcessorList([stamp]))
    sync(device)
    end = time.perf_counter()
    new = out[:, input_ids.shape[1]:]
    return {"total_s": end - t0, "tokens": [int(new.shape[1])] * len(new),
            "prefill_s": stamps[0] - t0, "decode_step_s": (end - stamps[0]) / (n - 1),
            "token_ids": new.tolist()}


def _time_memory(src, dst, times: int = 3) -> tuple[float, float]:
    """Median seconds of dst.copy_(src), and of reading both (src.sum(), dst.sum()). On CUDA a
    timed region runs each `reps` times between synchronizes (a 256 MiB copy takes ~0.1 ms on
    an H200, comparable to a launch plus a synchronize) and reports one run's share."""
    reps = 20 if src.device.type == "cuda" else 1
    dst.copy_(src)
    src.sum(), dst.sum()
    copy, read = [], []
    for _ in range(times):
        sync(src.device)
        t0 = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src)
        sync(src.device)
        t1 = time.perf_counter()
        for _ in range(reps):
            src.sum(), dst.sum()
        sync(src.device)
        copy.append((t1 - t0) / reps)
        read.append((time.perf_counter() - t1) / reps)
    return statistics.median(copy), statistics.median(read)


def _rank(rank: int, world: int, cfg: dict, spec, requests, device: str = "cpu") -> dict | None:
    import torch

    from atoll.engine.runner import ModelRunner
    from atoll.parallel.layout import Layout
    from atoll.parallel.mesh import ParallelContext

    layout = Layout.parse(spec.layout)
    ctx = ParallelContext.create(layout, rank, device) if world > 1 else ParallelContext.single(device)
    runner = ModelRunner(spec, ctx)
    dev = runner.device
    weight_bytes = ctx.world.all_reduce(
        torch.tensor([decode_weight_bytes(runner.model, cfg["batch"])], dtype=torch.float64, device=dev))
    own_threads, all_threads = torch.get_num_threads(), cfg["threads"]["transformers"]
    if rank == 0:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging

        logging.set_verbosity_error()
        logging.disable_progress_bar()
        # the same dtype as atoll's runner, loaded once and moved (no second copy kept)
        hf = AutoModelForCausalLM.from_pretrained(spec.model_dir, dtype=runner.dtype).eval().to(dev)
        input_ids = torch.tensor([r.prompt_token_ids for r in requests], device=dev)
        src = torch.ones(cfg["copy_mib"] * 2**20 // 4, dtype=torch.float32, device=dev)
        dst = torch.empty_like(src)
        cfg = cfg | {"device": str(dev), "dtype": str(runner.dtype).removeprefix("torch."),
                     "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}

    def baseline():  # rank 0 alone, with every thread of the job; the others wait
        if rank == 0:
            torch.set_num_threads(all_threads)
            res = _time_transformers(hf, input_ids, cfg["output_len"]), *_time_memory(src, dst)
            torch.set_num_threads(own_threads)
        ctx.world.barrier()
        return res if rank == 0 else None

    step = runner.decode_step  # None: eager only

    def atoll(compiled: bool, pipelined: bool = True) -> dict:
        runner.decode_step = step if compiled else None
        return time_atoll(runner, requests, pipelined=pipelined)

    paths = [True, False] if step is not None else [False]  # the default path first
    rounds, pipeline, loads = [], [], []
    for i in range(cfg["warmup"] + cfg["rounds"]):
        ctx.world.barrier()
        if i % 2:
            base = baseline()
            mine = [atoll(c) for c in reversed(paths)][::-1]
        else:
            mine = [atoll(c) for c in paths]
            base = baseline()
        # under PP, the same requests again with one micro-batch in flight at a time
        one = atoll(paths[0], pipelined=False) if ctx.layout.pp > 1 else None
        if i >= cfg["warmup"] and rank == 0:
            rounds.append((mine[0], *base, mine[1] if len(mine) > 1 else None))
            loads.append(os.getloadavg()[0])
            pipeline.append((mine[0], one))
    runner.decode_step = step
    if rank != 0:
        return None
    path = "eager" if step is None else ("cuda graphs" if dev.type == "cuda" else "compiled")
    cfg = cfg | {"path": path}
    result = summarize(cfg, rounds, float(weight_bytes))
    result["load_avg_rounds"] = [round(x, 2) for x in loads]
    if step is not None:
        result["compile"] = {"buckets": step.buckets, "run": step.buckets_run,
                             "compile_s": [sig(s, 3) for _, s in step.compiles], "freezing": step.freezing,
                             "error": getattr(step, "error", None)}
    if step is not None and world == 1 and hasattr(step, "replay_seconds"):  # the GPU's share of a step
        seconds = step.replay_seconds(next(b for b in step.buckets if b >= cfg["batch"]))
        if seconds is not None:
            result["graph_replay_s"] = sig(seconds)
            result["graph_replay_of_bandwidth_floor"] = sig(result["floor_step_s"] / seconds)
    if ctx.layout.pp > 1:
        result["pipeline"] = summarize_pipeline(pipeline, ctx.layout)
    return result


def sig(x: float, digits: int = 5) -> float:
    return float(f"{x:.{digits}g}")


def summarize(cfg: dict, rounds: list, weight_bytes: float) -> dict:
    med = statistics.median

    def side(k: int) -> dict:
        runs = [r[k] for r in rounds]
        total, tokens = med(r["total_s"] for r in runs), sum(runs[0]["tokens"])
        return {"total_s": sig(total), "output_tokens": tokens,
                "tokens_per_s": sig(tokens / total),
                "prefill_s": sig(med(r["prefill_s"] for r in runs)),
                "decode_step_s": sig(med(r["decode_step_s"] for r in runs))}

    atoll, hf = side(0), side(1)
    ratios = [r[1]["total_s"] / r[0]["total_s"] for r in rounds]  # each round pairs atoll with transformers
    two = 2 * cfg["copy_mib"] * 2**20
    bandwidth = two / med(r[2] for r in rounds)  # copy: read + write bytes per second
    read_bandwidth = two / med(r[3] for r in rounds)  # reading both tensors
    floor = weight_bytes / bandwidth
    last = rounds[-1]
    same = sum(a == b for a, b in zip(last[0]["token_ids"], last[1]["token_ids"]))
    return {"config": cfg, "atoll": atoll, "transformers": hf,
            "vs_transformers": sig(med(ratios)),  # the median of the per-round pairs
            "vs_transformers_range": [sig(min(ratios)), sig(max(ratios))],
            "decode_weight_bytes": int(weight_bytes), "copy_bandwidth_gb_s": sig(bandwidth / 1e9),
            "floor_step_s": sig(floor),
            "of_bandwidth_floor": sig(floor / atoll["decode_step_s"]),
            "transformers_of_bandwidth_floor": sig(floor / hf["decode_step_s"]),
            "read_bandwidth_gb_s": sig(read_bandwidth / 1e9),
            "of_read_bandwidth_floor": sig(weight_bytes / read_bandwidth / atoll["decode_step_s"]),
            "same_greedy_sequences": same} | _eager_side(rounds, side, floor)


def _eager_side(rounds: list, side, floor: float) -> dict:
    """With the compiled path measured, the eager one beside it (rounds[k][4]), paired with the
    same transformers runs."""
    if rounds[0][4] is None:
        return {}
    eager, compiled = side(4), side(0)
    ratios = [r[1]["total_s"] / r[4]["total_s"] for r in rounds]
    last = rounds[-1]
    pairs = [r[4]["total_s"] / r[0]["total_s"] for r in rounds]  # compiled and eager in one round
    return {"atoll_eager": eager,
            "eager_vs_transformers": sig(statistics.median(ratios)),
            "eager_vs_transformers_range": [sig(min(ratios)), sig(max(ratios))],
            "eager_of_bandwidth_floor": sig(floor / eager["decode_step_s"]),
            "compiled_vs_eager": sig(statistics.median(pairs)),
            "compiled_vs_eager_decode_step": sig(eager["decode_step_s"] / compiled["decode_step_s"]),
            "same_tokens_compiled_and_eager": last[0]["token_ids"] == last[4]["token_ids"]}


def summarize_pipeline(rounds: list, layout) -> dict:
    """Pipelined (pp lanes) against one micro-batch at a time; busy: per stage, the mean over
    its ranks of the fraction of the run spent computing (the rest is the bubble)."""
    med = statistics.median

    def stage_busy(runs) -> list[float]:
        per_rank = [med(r["busy"][k] for r in runs) for k in range(layout.world_size)]
        size = layout.stage_size
        return [sig(statistics.mean(per_rank[s * size:(s + 1) * size]), 3) for s in range(layout.pp)]

    piped, one = [r[0] for r in rounds], [r[1] for r in rounds]
    tokens = sum(piped[0]["tokens"])
    busy, busy_one = stage_busy(piped), stage_busy(one)
    return {"tokens_per_s": sig(tokens / med(r["total_s"] for r in piped)),
            "one_at_a_time_tokens_per_s": sig(tokens / med(r["total_s"] for r in one)),
            "vs_one_at_a_time": sig(med(b["total_s"] for b in one) / med(a["total_s"] for a in piped)),
            "stage_busy": busy, "bubble": sig(1 - statistics.mean(busy), 3),
            "one_at_a_time_stage_busy": busy_one, "one_at_a_time_bubble": sig(1 - statistics.mean(busy_one), 3),
            "same_tokens": piped[-1]["token_ids"] == one[-1]["token_ids"]}


def render(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    c, a, h = r["config"], r["atoll"], r["transformers"]
    e = r.get("atoll_eager")  # beside the compiled path, when it ran
    th = c["threads"]
    title = (f"{os.path.basename(c['model'].rstrip('/'))} {c['layout']} {c['dtype']} on {c['device_name']}: "
             f"batch {c['batch']}, {c['input_len']} in, {c['output_len']} out; median of {c['rounds']} rounds")
    t = Table(title=title)
    cols = ["measure", f"atoll {c.get('path', 'eager')}"] + (["atoll eager"] if e else []) + ["transformers"]
    for col in cols:
        t.add_column(col, justify="left" if col == "measure" else "right")

    def row(name, mine, eager="", theirs=""):
        t.add_row(name, mine, *([eager] if e else []), theirs)

    ms = lambda s: f"{s * 1e3:.1f} ms"  # noqa: E731

    def each(name, f):  # a measure of every side
        row(name, f(a), f(e) if e else "", f(h))

    ranks = f"{th['ranks']} x {th['atoll_per_rank']}"
    row("threads", ranks, ranks, str(th["transformers"]))
    each("end to end (prefill + decode)", lambda x: ms(x["total_s"]))
    each("output tokens", lambda x: str(x["output_tokens"]))
    each("tokens/s", lambda x: f"{x['tokens_per_s']:.1f}")
    each("prefill (time to first token)", lambda x: ms(x["prefill_s"]))
    each("decode step", lambda x: ms(x["decode_step_s"]))
    row("bandwidth floor / decode step", f"{r['of_bandwidth_floor']:.2f}",
        f"{r['eager_of_bandwidth_floor']:.2f}" if e else "", f"{r['transformers_of_bandwidth_floor']:.2f}")
    lo, hi = r["vs_transformers_range"]
    vs = f"{r['vs_transformers']:.2f}x ({lo:.2f} - {hi:.2f})"
    if e:
        elo, ehi = r["eager_vs_transformers_range"]
        row("vs transformers: median of round pairs (min - max)", vs, f"{r['eager_vs_transformers']:.2f}x ({elo:.2f} - {ehi:.2f})")
        row("compiled vs eager: tokens/s, decode step", f"{r['compiled_vs_eager']:.2f}x, "
            f"{r['compiled_vs_eager_decode_step']:.2f}x")
        cp = r["compile"]
        row("compile (s), buckets run", f"{', '.join(map(str, cp['compile_s']))}; {', '.join(map(str, cp['run']))}"
            + (", frozen" if cp["freezing"] else ""))
    else:
        row("vs transformers: median of round pairs (min - max)", vs)
    row("weights read per decode step", f"{r['decode_weight_bytes'] / 2**20:.1f} MiB")
    row("copy bandwidth (read + write)", f"{r['copy_bandwidth_gb_s']:.2f} GB/s")
    row("floor step (weights / bandwidth)", ms(r["floor_step_s"]))
    row("read bandwidth (sum of both tensors)", f"{r['read_bandwidth_gb_s']:.2f} GB/s")
    row("read-bandwidth floor / decode step", f"{r['of_read_bandwidth_floor']:.2f}")
    row("same greedy tokens as transformers (last round)", f"{r['same_greedy_sequences']}/{c['batch']} sequences")
    if e:
        row("same tokens compiled and eager (last round)", str(r["same_tokens_compiled_and_eager"]))
    row("load average 1 min (start, end; highest after a round)",
        ", ".join(map(str, r["load_avg_1m"])) + f"; {max(r['load_avg_rounds'], default=0):.2f}")
    if "pipeline" in r:
        p = r["pipeline"]
        row("tokens/s, one micro-batch at a time", f"{p['one_at_a_time_tokens_per_s']:.1f}")
        row("stage busy, pipelined", " / ".join(f"{b:.2f}" for b in p["stage_busy"]))
        row("stage busy, one at a time", " / ".join(f"{b:.2f}" for b in p["one_at_a_time_stage_busy"]))
    Console().print(t)
    if "pipeline" in r:
        p = r["pipeline"]
        print(f"pipelined vs one micro-batch at a time: {p['vs_one_at_a_time']:.2f}x "
              f"(bubble {p['bubble']:.2f} vs {p['one_at_a_time_bubble']:.2f}, same tokens: {p['same_tokens']})")
    if e:
        print(f"eager vs transformers: {r['eager_vs_transformers']:.2f}x, "
              f"compiled vs eager: {r['compiled_vs_eager']:.2f}x")
    print(f"vs transformers: {r['vs_transformers']:.2f}x")  # the default path
    print(f"of bandwidth floor: {r['of_bandwidth_floor']:.2f}")
