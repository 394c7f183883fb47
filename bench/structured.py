"""atoll bench structured: the same requests with and without a JSON schema, side by side in one
run on the same ranks, at each --batch; and the grammar's compile time, cold and cached.

Each request asks for a list of records and the schema allows a long one (an array of at least
64 objects), so both sides generate --output-len tokens (greedy, ignore_eos): tokens/s compares
the same work with and without the grammar's mask. The ranks are spawned once; each round runs
free then schema (the order alternating between rounds) after an untimed warm-up of each.
Reported, medians over --rounds: output tokens per second, the ratio schema / free, the masks'
fill time and the part of it sampling waited for (the rest ran beside the forward), the
1-minute load average before each timed run; with --speculative-config both sides speculate
and the acceptance rate of each is given."""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

from atoll.bench.harness import Run
from atoll.config.speculative import SpeculativeConfig
from atoll.config.structured import StructuredOutputs
from atoll.engine.batch.tokenizer import Tokenizer
from atoll.engine.rank.loop import run_batch
from atoll.engine.rank.runner import ModelRunner
from atoll.engine.sample.grammar import Grammars
from atoll.engine.sample.sampler import SamplingParams
from atoll.engine.spec import stats as spec_stats
from atoll.errors import ConfigError
from atoll.launch.api import LLM
from atoll.models import ModelConfig
from atoll.launch.local import run_local
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ParallelContext

ITEM = {"type": "object", "additionalProperties": False, "required": ["name", "city", "age"],
        "properties": {"name": {"type": "string", "maxLength": 24}, "city": {"type": "string", "maxLength": 24},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["people"],
          "properties": {"people": {"type": "array", "items": ITEM, "minItems": 64}}}
ASKS = ["List people with their name, city and age as JSON.", "Give a JSON list of customers: name, city, age.",
        "Make up a JSON roster of club members (name, city, age).", "JSON please: many people, name city age."]


def add_parser(sub) -> None:
    p = sub.add_parser("structured", help="a JSON schema's cost: tokens/s with and without, grammar compile time",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: the demo model, SmolLM2-135M)")
    p.add_argument("--layout", default="TP1", help="atoll layout (default TP1)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="requests running together (default 1 16)")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens per request (default 128)")
    p.add_argument("--rounds", type=int, default=1, help="rounds, each running free and schema (default 1)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='both sides speculate, e.g. {"method": "ngram", "num_speculative_tokens": 4}')
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=run)


def run(args) -> int:
    for name in ("output_len", "rounds"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
    if any(b < 1 for b in args.batch):
        raise ConfigError(f"--batch {args.batch}: each must be at least 1")
    speculative = SpeculativeConfig.parse(args.speculative_config) if args.speculative_config else None
    with Run(args.model, quiet=args.json) as bench:
        args.model = bench.model
        compile_times = compile_time(args.model)
        tok = Tokenizer(args.model)
        widest = max(args.batch)
        ids = [tok.encode_chat(ASKS[i % len(ASKS)]) for i in range(widest)]
        llm = LLM(args.model, layout=args.layout, max_num_seqs=widest, enforce_eager=False,
                  max_model_len=max(map(len, ids)) + args.output_len + 8)
        free = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
        requests = llm.prepare(ids, [free] * widest)
        spec = llm.spec(requests).with_engine(speculative_config=speculative)
        result = run_local(_rank, llm.layout.world_size, spec, requests, args.batch, args.rounds, timeout_s=3600,
                           device=spec.engine.device)[0]
    result |= {"model": args.model, "layout": str(llm.layout), "output_len": args.output_len, "rounds": args.rounds,
               "speculative_config": args.speculative_config, "compile": compile_times}
    bench.emit(result, as_json=args.json, render=render)
    return 0


def compile_time(model: str) -> dict:
    """Seconds to make llguidance's tokenizer, to compile SCHEMA cold, and to take it cached."""

    g = Grammars(model, ModelConfig.load(model).vocab_size, None)
    so = StructuredOutputs(json=SCHEMA)
    t0 = time.perf_counter()
    g.tokenizer
    t1 = time.perf_counter()
    g.state(so).matcher.compute_bitmask()  # the first mask completes the lazy parts of the compile
    t2 = time.perf_counter()
    g.state(StructuredOutputs(json=dict(SCHEMA))).matcher.compute_bitmask()
    t3 = time.perf_counter()
    return {"tokenizer_s": t1 - t0, "cold_s": t2 - t1, "cached_s": t3 - t2}


def _rank(rank: int, world: int, spec, requests, batches: list[int], rounds: int, device: str = "cpu"):
    layout = Layout.parse(spec.layout)
    ctx = ParallelContext.create(layout, rank, device) if world > 1 else ParallelContext.single(device)
    runner = ModelRunner(spec, ctx)
    schema = StructuredOutputs(json=SCHEMA)
    sides = {"free": requests,
             "schema": [dataclasses.replace(r, params=dataclasses.replace(r.params, structured_outputs=schema))
                        for r in requests]}
    for reqs in sides.values():  # untimed: every prompt and a few tokens on each side
        run_batch(runner, [dataclasses.replace(r, params=dataclasses.replace(r.params, max_tokens=4)) for r in reqs])
    out = {}
    for b in batches:
        runs = {"free": [], "schema": []}
        for i in range(rounds):
            for name in (("free", "schema") if i % 2 == 0 else ("schema", "free")):
                ctx.world.barrier()
                runs[name].append(measure(runner, sides[name][:b]))
        out[b] = {name: summarize(r) for name, r in runs.items()}
        out[b]["ratio"] = out[b]["schema"]["tok_s"] / out[b]["free"]["tok_s"]
    return {"device": str(runner.device), "batches": out} if rank == 0 else None


def measure(runner, requests) -> dict:
    g = runner.grammars
    load, before = os.getloadavg()[0], (g.masks, g.mask_s, g.waited_s)
    t0 = time.perf_counter()
    results = run_batch(runner, requests)
    total = time.perf_counter() - t0
    tokens = sum(len(r["token_ids"]) for r in results)
    return {"total_s": total, "tok_s": tokens / total, "load_avg_1m": load, "masks": g.masks - before[0],
            "mask_s": g.mask_s - before[1], "waited_s": g.waited_s - before[2],
            "spec": spec_stats.summarize([r["metrics"] for r in results])}


def summarize(runs: list[dict]) -> dict:
    out = {k: statistics.median(r[k] for r in runs) for k in ("tok_s", "total_s", "mask_s", "waited_s", "masks")}
    out["load_avg_1m"] = [round(r["load_avg_1m"], 2) for r in runs]
    if runs[0]["spec"] is not None:
        out["acceptance_rate"] = statistics.median(r["spec"]["acceptance_rate"] for r in runs)
    return out


def render(r: dict) -> str:
    c = r["compile"]
    lines = [f"structured outputs on {r['model']} ({r['layout']}, {r['device']}): {r['output_len']} tokens a request, "
             f"{r['rounds']} round(s){', speculative ' + r['speculative_config'] if r['speculative_config'] else ''}",
             f"  grammar: tokenizer {c['tokenizer_s'] * 1e3:.0f} ms once, schema compile cold "
             f"{c['cold_s'] * 1e3:.2f} ms, cached {c['cached_s'] * 1e3:.3f} ms"]
    for b, sides in r["batches"].items():
        for name in ("free", "schema"):
            s = sides[name]
            acc = f", acceptance {s['acceptance_rate']:.1%}" if "acceptance_rate" in s else ""
            masks = (f", masks {s['mask_s'] * 1e3:.0f} ms over {s['masks']:.0f} steps, waited {s['waited_s'] * 1e3:.0f} ms"
                     if name == "schema" else "")
            lines.append(f"  batch {b:>3} {name:>6}: {s['tok_s']:8.1f} tok/s ({s['total_s']:.2f} s){acc}{masks}  "
                         f"load {s['load_avg_1m']}")
        lines.append(f"  batch {b:>3} schema / free: {sides['ratio']:.3f}")
    return "\n".join(lines)
