"""atoll bench: atoll's generate loop against transformers' `generate` on the same model, and
atoll's decode step against the memory-bandwidth floor of this machine, in one run.

A fixed batch of equal-length random-token prompts (no padding) generates exactly
--output-len tokens per sequence on both sides: atoll with ignore_eos, transformers greedy
with min_new_tokens = max_new_tokens. Both run on the rank's device (--device, bound by the
launcher: launch/device.py) in the same dtype (--dtype; default as the runtime: the
checkpoint's torch_dtype on CUDA, float32 on CPU). The ranks are spawned once; inside them
the runner and the transformers model are built, then every round times atoll's
`run_batch` with the compiled decode step (engine.step.compiled) and with the eager one, then
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

import os

import torch
from rich.console import Console
from rich.table import Table

from atoll.bench import quant
from atoll.bench.harness import Run
from atoll.bench.model_rank import _rank
from atoll.config import DEVICES, DTYPES
from atoll.config.engine import QUANTIZATIONS
from atoll.engine.kv.sizing import cpu_blocks
from atoll.engine.sample.sampler import SamplingParams
from atoll.errors import ConfigError
from atoll.launch.api import LLM
from atoll.launch.local import run_local


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
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="atoll with these weights against atoll unquantized, side by side (bench/quant.py)")
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
    cfg = check(args)
    with Run(args.model, quiet=args.json) as bench:
        llm, spec, requests = prepare(bench.model, args.layout, batch=cfg["batch"], input_len=cfg["input_len"],
                                      output_len=cfg["output_len"], seed=cfg["seed"], device=args.device,
                                      dtype=args.dtype, enforce_eager=args.enforce_eager)
        if llm.layout.dp > 1:
            raise ConfigError(f"layout {llm.layout}: the model bench runs layouts without dp")
        if args.quantization is not None:  # quantized against unquantized instead of against transformers
            return quant.run(args, bench, cfg, llm, spec, requests)
        world = llm.layout.world_size
        threads = args.threads or max(1, bench.cores // world)
        cfg |= {"model": bench.model, "layout": str(llm.layout),
                "threads": {"atoll_per_rank": threads, "ranks": world, "transformers": threads * world}}
        result = run_local(_rank, world, cfg, spec, requests, threads=threads, timeout_s=3600,
                           device=spec.engine.device)[0]
    bench.emit(result, as_json=args.json, render=render, more_loads=result["load_avg_rounds"])
    return 0


def prepare(model, layout, *, batch: int, input_len: int, output_len: int, seed: int = 0, device: str = "auto",
            dtype: str | None = None, enforce_eager: bool = False):
    """(LLM, RunSpec, requests): `batch` random-token prompts of `input_len` tokens, each to
    generate exactly `output_len` tokens, and a KV cache of what they need."""
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
    return llm, llm.spec().with_engine(num_blocks=blocks), requests


def render(r: dict) -> None:
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
