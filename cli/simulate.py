"""`atoll simulate`: a deployment under a load, simulated (planner/sim): atoll's own scheduler,
block pools, router and disaggregation decision, each step timed by the cost model on
--topology. It takes `atoll bench serve`'s load flags and the engine flags alike, so one command
line can be simulated here and run there, and prints the bench's table: throughput, mean and
percentiles of TTFT, TPOT, ITL and E2EL, SLO attainment and goodput, then each engine's busy
share and what its steps spent their time on."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from tqdm import tqdm

from atoll.bench.serve import add_load_options, check_load
from atoll.config import add_model_options, resolve
from atoll.config.speculative import SpeculativeConfig
from atoll.engine.batch.router import ROUTERS
from atoll.engine.batch.tokenizer import Tokenizer
from atoll.parallel.layout import resolve_layout
from atoll.errors import ConfigError, InputError
from atoll.models.gguf import demo_model_dir
from atoll.models.presets import resolve_model
from atoll.planner.sim import Deployment, simulate
from atoll.planner.sim.deploy import on_cpu
from atoll.planner.sim.load import jsonl_requests, mixed_requests, random_requests, shared_prefix_requests
from atoll.planner.sim.report import report_lines
from atoll.topologies import load_topology

PROMPTS = ("random", "shared-prefix", "long-mix")
_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "bf16"}


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="simulate a deployment under a load: bench serve's figures, predicted",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="preset (DeepSeek-V3, ...) or a HF config or checkpoint dir "
                                                 "(default: the demo model, SmolLM2-135M)")
    p.add_argument("--topology", default="local", help="preset or YAML (default local; `atoll calibrate` writes "
                                                       "a measured one)")
    p.add_argument("--replicas", type=int, default=None,
                   help="replicas of the layout behind the router (default 1; a dense model's -dp N means N too)")
    p.add_argument("--router", default="cache_aware", choices=ROUTERS, help="which replica takes a request")
    p.add_argument("--prompts", choices=PROMPTS, default="random",
                   help="random ids (default), shared-prefix (--system-prompts prefixes of --input-len, then "
                        "--user-len own ids), or long-mix (a --long-share of --long-len prompts)")
    p.add_argument("--acceptance", type=float, default=None,
                   help="with --speculative-config: the chance each drafted token is kept (bench serve's "
                        "/metrics measure it)")
    p.add_argument("--draft-rate", type=float, default=1.0,
                   help="with --speculative-config: the share of decode steps that get a draft (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_load_options(p)
    engine = p.add_argument_group("engine flags, as `atoll serve` takes them")
    add_model_options(engine, defaults=resolve())
    p.set_defaults(run=run)


def run(args) -> int:
    slos, percentiles = check_load(args)
    topology = load_topology(args.topology)
    model = args.model or str(demo_model_dir())
    name, config = resolve_model(str(model))
    deployment = deployment_of(args, config, topology)
    requests = build(args, config, model)
    shown = not args.no_progress and sys.stderr.isatty()
    with tqdm(total=len(requests), desc="simulating", unit="req", file=sys.stderr, disable=not shown, delay=1.0,
              leave=False, mininterval=0.2) as bar:
        out = simulate(config, topology, deployment, requests, rate=args.request_rate, burstiness=args.burstiness,
                       max_concurrency=args.max_concurrency, seed=args.seed, slos=slos, percentiles=percentiles,
                       progress=bar.update)
    out = {"model": name, "num_prompts": len(requests),
           "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate, **out}
    print(json.dumps(out, indent=1) if args.json else render(out))
    return 0


def deployment_of(args, config, topology) -> Deployment:
    """The deployment the engine flags describe (a dense model's dp as replicas, as atoll serve)."""
    disagg = args.prefill is not None or args.decode is not None
    layout = resolve_layout(args.layout, args.tensor_parallel_size, args.pipeline_parallel_size,
                            args.data_parallel_size, args.expert_parallel_size, args.context_parallel_size)
    replicas = args.replicas or 1
    if not config.is_moe and layout.dp > 1:
        if args.replicas is not None:
            raise InputError(f"give replicas as --replicas or as the layout's dp ({layout}), not both")
        replicas, layout = layout.dp, type(layout)(tp=layout.tp, pp=layout.pp, cp=layout.cp)
    cpu = on_cpu(topology)
    dtype = _DTYPES.get(args.dtype or "", "fp32" if cpu else "auto")
    kv = {"auto": dtype, "fp8": "fp8", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2", "int8": "int8"}
    spec_k, acceptance = 0, 0.0
    if args.speculative_config:
        cfg = args.speculative_config if isinstance(args.speculative_config, SpeculativeConfig) \
            else SpeculativeConfig.parse(args.speculative_config)
        if args.acceptance is None:
            raise ConfigError("--speculative-config needs --acceptance: the chance a drafted token is kept "
                              "(atoll_spec_accepted_tokens over atoll_spec_draft_tokens in a server's /metrics)")
        spec_k, acceptance = cfg.k, args.acceptance
    return Deployment(layout=str(layout), replicas=replicas, prefill=args.prefill if disagg else None,
                      decode=args.decode if disagg else None, prefill_replicas=args.prefill_replicas,
                      decode_replicas=args.decode_replicas, router=args.router, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                      max_model_len=args.max_model_len, prefix_caching=bool(args.enable_prefix_caching),
                      dtype=dtype, kv_dtype=kv.get(args.kv_cache_dtype or "auto", dtype), num_blocks=args.num_blocks,
                      gpu_memory_utilization=args.gpu_memory_utilization, spec_tokens=spec_k, acceptance=acceptance,
                      draft_rate=args.draft_rate, min_prompt_tokens=args.disagg_min_prompt_tokens,
                      max_prefill_queue=args.disagg_max_prefill_queue)


def build(args, config, model) -> list:
    """The load's requests, as `atoll bench serve` builds them for the same flags."""
    osl, n, vocab = args.output_len or 32, args.num_prompts, config.vocab_size
    if args.dataset:
        rows = jsonl_requests(args.dataset, n, output_len=osl)
        if any(isinstance(r.prompt, str) for r in rows):
            tok = _tokenizer(model)
            rows = [type(r)(tok.encode(r.prompt) if isinstance(r.prompt, str) else r.prompt, r.output_len) for r in rows]
        return rows
    if args.prompts == "shared-prefix":
        return shared_prefix_requests(n, systems=args.system_prompts, system_len=args.input_len,
                                      user_len=args.user_len, output_len=osl, vocab_size=vocab, seed=args.seed)
    if args.prompts == "long-mix":
        return mixed_requests(n, input_len=args.input_len, long_len=args.long_len, long_share=args.long_share,
                              output_len=osl, vocab_size=vocab, seed=args.seed)
    return random_requests(n, input_len=args.input_len, output_len=osl, vocab_size=vocab, seed=args.seed,
                           range_ratio=args.range_ratio)


def _tokenizer(model) -> Tokenizer:
    path = Path(str(model))
    if not (path / "tokenizer.json").is_file():
        raise InputError(f"--dataset holds text prompts: --model {model} has no tokenizer.json to count their tokens "
                         "(give token ids, or a checkpoint dir)")
    return Tokenizer(path)


def render(r: dict) -> str:
    rate = r["request_rate"] if r["request_rate"] == "inf" else f"{r['request_rate']:g}"
    lines = [f"{r['model']} simulated: {r['deployment']} on {r['topology']} ({r['gpus']} GPUs), "
             f"{r['num_prompts']} requests, rate {rate} req/s",
             *report_lines(r["serve"])]
    if r.get("goodput_per_gpu") is not None:
        lines.append(f"  goodput per GPU {r['goodput_per_gpu']:.3f} req/s")
    for e in r["engines"]:
        busy = "-" if e["busy_share"] is None else f"{e['busy_share']:.2f}"
        bound = ", ".join(f"{b['what']} {b['share']:.0%}" for b in e["bound_by"])
        spec = ""
        if e["spec"]:
            s = e["spec"]
            spec = f"; drafts kept {s['accepted']}/{s['drafted']}"
        lines.append(f"  {e['engine']} ({e['layout']}): busy {busy}, {e['ticks']} ticks, "
                     f"{e['preemptions']} preemptions, {e['num_blocks']} KV blocks; steps: {bound}{spec}")
    if r["routed"]:
        lines.append("  routed: " + ", ".join(f"{k} {v}" for k, v in r["routed"].items()))
    lines.append(f"  simulated in {r['sim_wall_s']:.2f} s")
    return "\n".join(lines)
