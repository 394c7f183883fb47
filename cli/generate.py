"""atoll generate: run prompts through a model at a given layout."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

from atoll import config
from atoll.cli.progress import ProgressBar
from atoll.cli.requests import Line, ResultWriter, check_output, read_prompts
from atoll.comm.eplb import describe as expert_load_lines
from atoll.config.sampling import SamplingParams
from atoll.engine.spec import stats as spec_stats
from atoll.engine.worker import worker
from atoll.errors import AtollError, InputError, LaunchError
from atoll.launch.api import RankLauncher, RayLauncher, llm_from_args
from atoll.launch.launchers import check_launcher, detect, is_first_rank
from atoll.models.config import ModelConfig
from atoll.parallel.links import lines as link_lines
from atoll.planner import Workload, enumerate_layouts, plan_layouts
from atoll.planner.planfile import from_plan, load_plan
from atoll.topologies import discover, load_topology


def add_model_options(p) -> None:
    config.add_model_options(p, defaults=config.resolve())  # ATOLL_* variables set the defaults


def add_sampling_options(p) -> None:
    d = SamplingParams()  # the library's defaults are the flags' defaults
    p.add_argument("--max-new-tokens", type=int, default=d.max_tokens, help=f"default {d.max_tokens}")
    p.add_argument("--temperature", type=float, default=d.temperature, help="0 means greedy")
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end a request when its text contains TEXT (repeatable)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the end-of-sequence token, to max tokens (benchmarks)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to text prompts")


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for prompts at a parallel layout")
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt text")
    src.add_argument("--prompts", metavar="FILE.jsonl",
                     help='one request a line: {"id": ..., "prompt": "..."} or "prompt_token_ids": [...], and '
                          "optionally max_tokens, temperature, top_p, top_k, seed, stop, ignore_eos, n, logprobs, "
                          "prompt_logprobs, presence_penalty, frequency_penalty, repetition_penalty, logit_bias, "
                          "min_tokens, stop_token_ids, bad_words, structured_outputs ({\"json\": schema} or "
                          "regex, choice, grammar, json_object) for that request (vLLM's meanings); "
                          "a bad line becomes its own error line and the others run")
    p.add_argument("--output", metavar="FILE.jsonl",
                   help="write results here instead of stdout: one line per request with its id and input "
                        "line, written as each finishes, put in input order when the run ends")
    p.add_argument("--launcher", default="auto", choices=["auto", "local", "torchrun", "ray", "mpi"],
                   help="auto: torchrun or mpirun if launched by one, else local processes")
    p.add_argument("--ray-address", default=None, help="Ray cluster to join (default: start Ray here)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--plan", metavar="PLAN.yaml", default=None,
                   help="run the layout and rank placement of a plan from `atoll plan --save` (instead of --layout)")
    p.add_argument("--strict-placement", action="store_true",
                   help="refuse to run when a rank's node or GPU differs from the plan (Ray, torchrun, mpirun); "
                        "without it the difference is one warning line")
    p.add_argument("--stats", action="store_true",
                   help="at the end, one line per link class (island, node, network): the bytes the ranks sent "
                        "over it, for MoE dispatch and for all collectives; and for an MoE model each layer's "
                        "max/mean tokens per EP rank over the expert load window (--eplb-window-size)")
    p.add_argument("--expert-load-out", metavar="FILE", default=None,
                   help="MoE: write the expert load window at the end (each layer's tokens per EP rank and per "
                        "logical expert, JSON) for `atoll plan --expert-loads`; never over an existing file")
    add_model_options(p)
    add_sampling_options(p)
    p.set_defaults(run=run)


# SamplingParams' fields -> the flags that set them (its messages start with `field=`)
FLAGS = {"max_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p",
         "top_k": "--top-k", "seed": "--seed", "stop": "--stop", "ignore_eos": "--ignore-eos"}


def sampling_params(args):
    try:
        return SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
                              ignore_eos=getattr(args, "ignore_eos", False))
    except InputError as e:
        field, _, rest = str(e).partition("=")
        field = field.split("[")[0]  # stop[1]=... names one --stop
        raise InputError(f"{FLAGS[field]} {rest}" if field in FLAGS else str(e)) from None


def make_llm(args, model_dir, layout=None):
    return llm_from_args(args, model_dir, layout)


def run(args) -> int:
    """Everything a user can get wrong is checked before any rank starts: the flags, the
    prompts file, the output path, the model; then each request on its own (a bad one
    becomes its own error line). Results are written as they finish (launch.requests)."""
    launcher = detect() if args.launcher == "auto" else args.launcher
    defaults = sampling_params(args)
    if args.prompts:
        lines = read_prompts(args.prompts)
    else:
        lines = [Line(None, 0, {"prompt": args.prompt})]
    if args.output:
        check_output(args.output, args.prompts)
    if args.expert_load_out:
        check_new_file(args.expert_load_out, "--expert-load-out")
    plan = args.saved_plan = _plan(args, launcher, lines)
    llm = make_llm(args, args.model, layout=str(plan.layout) if plan else None)
    ranks = llm.layout.world_size + (llm.prefill_layout.world_size if llm.prefill_layout else 0)
    check_launcher(launcher, device=llm.device, world_size=ranks)
    args.context = llm.context_options(islands=plan.islands if plan else None, nodes=plan.nodes if plan else None)
    valid = _validate(llm, lines, defaults, chat=args.chat)
    if not args.prompts and lines[0].error:
        raise InputError(f"--prompt: {lines[0].error}")
    return _generate(args, llm, lines, valid, launcher)


def _plan(args, launcher: str, lines):
    """The SavedPlan to run: --plan's file, or --layout auto's choice; None otherwise."""
    auto = str(args.layout).lower() == "auto"
    if not args.plan and not auto:
        return None
    sizes = [f for f, v in (("-tp", args.tensor_parallel_size), ("-pp", args.pipeline_parallel_size),
                            ("-dp", args.data_parallel_size), ("-ep", args.expert_parallel_size),
                            ("-cp", getattr(args, "context_parallel_size", None))) if v is not None]
    if args.plan and args.layout is not None or sizes:
        raise InputError(f"give {'--plan' if args.plan else '--layout auto'} or "
                         f"{'--layout' if args.plan and args.layout else ' '.join(sizes)}, not both")
    config = ModelConfig.load(args.model)
    if args.plan:
        plan = load_plan(args.plan)
        plan.check_model(config, where=f"--model {args.model}")
    else:
        plan = auto_plan(args, config, lines)
    if launcher == "local" and len(plan.placement.nodes) > 1:
        used = [plan.placement.node_names[n] for n in plan.placement.nodes]
        raise LaunchError(f"the plan puts ranks on {len(used)} nodes ({', '.join(used)}); the local launcher runs "
                          "one machine: use --launcher ray, or torchrun/mpirun on those nodes")
    print(f"atoll: {plan.summary()}", file=sys.stderr)
    return plan


def auto_plan(args, config, lines):
    """Plan one replica on this machine's topology (NVML, nvidia-smi, or the local preset) for
    these requests: concurrency = their number, lengths from the prompts and --max-new-tokens."""
    topology = discover()
    if args.device == "cpu" and topology.gpu.name != "cpu-core":
        topology = load_topology("local")
    prompts = [ln.prompt for ln in lines if ln.error is None] or [""]
    isl = max(max(len(p.get("prompt_token_ids", ())) if isinstance(p, dict) else 0,
                  len(p.get("prompt", "")) // 4 if isinstance(p, dict) and isinstance(p.get("prompt"), str) else 0)
              for p in prompts)
    workload = Workload(isl=max(isl, 1), osl=max(args.max_new_tokens, 1), concurrency=len(prompts))
    layouts = [f"1 x {lay}" for lay, _ in enumerate_layouts(config, topology)]
    plan = plan_layouts(config, topology, workload, layouts=layouts)
    return from_plan(dataclasses.replace(plan, model=str(args.model)), config)


def _validate(llm, lines, defaults, *, chat: bool) -> list[tuple[int, object]]:
    """(line index, Request) for every servable line; the others get Line.error. Each
    Request.index is its position in this list (what rank 0 reports back)."""
    keep = []
    for i, ln in enumerate(lines):
        if ln.error is None:
            try:
                keep.append((i, dataclasses.replace(defaults, **ln.sampling)))
            except InputError as e:
                ln.error = _where(ln, e)
    errors: dict[int, str] = {}
    requests = llm.prepare([lines[i].prompt for i, _ in keep], [p for _, p in keep], chat=chat,
                           errors=errors) if keep else []
    for k, msg in errors.items():
        lines[keep[k][0]].error = _where(lines[keep[k][0]], msg)
    valid = []
    for req in requests:
        i = keep[req.index][0]
        req.index = len(valid)
        valid.append((i, req))
    return valid


def _where(ln, e) -> str:
    return str(e) if ln.line is None else f"line {ln.line}: {e}"


def _hit_rate(results: list[dict]) -> str:
    """The summary line's tail: the share of prompt tokens served from the prefix cache."""
    prompt = sum(r["metrics"]["prompt_tokens"] for r in results)
    cached = sum(r["metrics"].get("cached_tokens", 0) for r in results)
    return f", prefix cache hit rate {cached / prompt:.1%} ({cached} of {prompt} prompt tokens)" if prompt else ""


def _row(ln, **fields) -> dict:
    return {"id": ln.id, **({} if ln.line is None else {"line": ln.line}), **fields}


def _generate(args, llm, lines, valid, launcher: str) -> int:
    writer = ResultWriter(args.output, enabled=_writes_output(launcher))
    failed = [i for i, ln in enumerate(lines) if ln.error is not None]
    for i in failed:
        writer.write(i, _row(lines[i], error=lines[i].error))
    if not valid:  # nothing to run: no rank is started
        writer.close()
        if writer.failure:
            raise AtollError(writer.failure)
        if writer.enabled:
            print(f"atoll: 0 done, {len(failed)} failed: no valid request", file=sys.stderr)
        return 1
    requests = [r for _, r in valid]

    def done(k, result):  # request k finished: its output line, written at once
        i, req = valid[k]
        out = llm.finish([lines[i].prompt], [req], [result])[0].to_json()
        writer.write(i, _row(lines[i], **{f: v for f, v in out.items() if f != "id"}))

    start = time.perf_counter()
    if llm.prefill_layout is not None:
        print(f"atoll: {len(requests)} prompts, prefill on {llm.prefill_layout}, decode on {llm.layout} "
              f"({llm.prefill_layout.world_size + llm.layout.world_size} ranks, {launcher})", file=sys.stderr)
    elif launcher in ("local", "ray"):
        print(f"atoll: {len(requests)} prompts on {llm.layout} ({llm.layout.world_size} ranks, {launcher})",
              file=sys.stderr)
    # the living engine (the one `atoll serve` runs) under every launcher, fed every request at once
    if llm.prefill_layout is None and launcher != "local":
        llm.launcher = _living_launcher(args, llm, launcher)
        if not writer.enabled:  # torchrun/mpirun, a rank but 0: serve until rank 0 says stop
            llm.launcher.join(worker, llm.layout.world_size, None, None, None, device=llm.options.device)
            return 0
    try:
        sent = None
        if llm.prefill_layout is not None:  # disaggregated: both engines in one living job (local or Ray)
            results = _disaggregated(args, llm, requests, launcher, done)
        else:  # results written as each ends, the progress bar fed by the engine's stream
            bar = ProgressBar(len(requests)) if not args.no_progress else None
            try:
                results = llm.generate_requests(requests, on_result=done, parallel=args.context,
                                                link_stats=args.stats or bool(args.expert_load_out),
                                                on_step=(lambda d, n: bar.put((d, n))) if bar else None)
            finally:
                if bar is not None:
                    bar.close()
                llm.close()
            sent = llm.links
        if writer.enabled:
            for k, result in enumerate(results):
                if not writer.written(valid[k][0]):
                    done(k, result)
    except BaseException as e:
        # nothing is lost silently: every request not written yet is listed, failed, with the cause
        cause = (str(e) if isinstance(e, AtollError) else (str(e) or "interrupted") if isinstance(e, KeyboardInterrupt)
                 else f"{type(e).__name__}: {e}")
        for i, ln in enumerate(lines):
            if not writer.written(i):
                writer.write(i, _row(ln, error=cause))
        writer.close()
        raise
    writer.close()
    if writer.failure:
        raise AtollError(writer.failure)
    if not writer.enabled:
        return 0
    elapsed = time.perf_counter() - start
    tokens = sum(len(r["token_ids"]) for r in results)
    print(f"atoll: {len(results)} done, {len(failed)} failed, {tokens} tokens in {elapsed:.1f}s "
          f"({tokens / elapsed:.1f} tok/s){_hit_rate(results) if llm.options.enable_prefix_caching else ''}"
          f"{spec_stats.describe([r['metrics'] for r in results if 'metrics' in r])}",
          file=sys.stderr)
    if sent is not None and args.stats:
        for line in expert_load_lines(sent.get("expert_load")) + link_lines(sent):  # MoE: tokens per EP rank
            print(f"atoll: {line}", file=sys.stderr)
    if args.expert_load_out:
        write_expert_load(args.expert_load_out, (sent or {}).get("expert_load"))
    return 1 if failed else 0


def check_new_file(path: str, flag: str) -> None:
    """InputError unless `path` names a file that does not exist yet in a directory that does."""
    p = Path(path)
    if p.exists():
        raise InputError(f"{flag} {p} exists: atoll does not write over it; give a new path")
    if not p.parent.is_dir():
        raise InputError(f"{flag} {p}: the directory {p.parent} does not exist")


def write_expert_load(path: str, report) -> None:
    """The engine's expert load report as JSON (planner/expert_balance.read_loads reads it)."""
    if not report or not report.get("layers"):
        print(f"atoll: --expert-load-out {path}: nothing written, the engine counted no expert load (a dense model, "
              "or EP 1)", file=sys.stderr)
        return
    with open(path, "x") as f:
        json.dump({"layers": {str(k): v for k, v in report["layers"].items()},
                   "window_steps": report.get("window_steps"), "rebalances": report.get("rebalances")}, f)
    print(f"atoll: wrote {path}: expert load of {len(report['layers'])} MoE layers over "
          f"{report.get('window_steps')} steps", file=sys.stderr)


def _disaggregated(args, llm, requests, launcher: str, done) -> list[dict]:
    """Both engines as one living job (engine.driver.disagg); each result written as it ends."""
    if launcher not in ("local", "ray"):
        raise LaunchError(f"--prefill/--decode run under the local or Ray launcher, not {launcher}")
    if launcher == "ray":
        llm.launcher = _living_launcher(args, llm, launcher)
    try:
        results = llm.generate_requests(requests, on_result=done)
    finally:
        llm.close()
    remote = sum(r["metrics"]["prefilled_on"] == "prefill" for r in results)
    sent = sum(r["metrics"]["kv_bytes_sent"] for r in results)
    print(f"atoll: {remote} of {len(results)} prompts prefilled on the prefill engine, "
          f"{sent / 2**20:.2f} MiB of KV sent", file=sys.stderr)
    return results


def _living_launcher(args, llm, launcher: str):
    """The launcher object that starts the living engine's ranks under Ray, torchrun or mpirun."""
    if launcher == "ray":  # each TP group on one node (a disaggregated job's two TP sizes: their gcd)
        tp = math.gcd(llm.layout.tp, llm.prefill_layout.tp) if llm.prefill_layout is not None else llm.layout.tp
        return RayLauncher(address=args.ray_address, tp_size=tp, parallel=args.context, **_placement(args))
    return RankLauncher(launcher, parallel=args.context, **_placement(args))


def _placement(args) -> dict:
    plan = getattr(args, "saved_plan", None)
    if plan is None:
        return {}
    return {"placement": plan.placement, "strict_placement": args.strict_placement}


def _writes_output(launcher: str) -> bool:
    """Whether this process writes the output: always, except under torchrun/mpirun, where
    every rank runs this command and rank 0 writes."""
    return is_first_rank(launcher)
