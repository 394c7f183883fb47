"""atoll generate: run prompts through a model at a given layout."""

from __future__ import annotations

import sys
import time


def add_model_options(p) -> None:
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, metavar="N")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None, metavar="N")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=None, metavar="N",
                   help="attention data parallel replicas inside a stage (MoE models)")
    p.add_argument("--expert-parallel-size", "-ep", type=int, default=None, metavar="N")
    p.add_argument("--layout", default=None, help="e.g. TP2PP2, DP2EP2 (instead of -tp/-pp/-dp/-ep)")
    from atoll.engine.config import add_cli_options

    add_cli_options(p)


def add_sampling_options(p) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end a request when its text contains TEXT (repeatable)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to text prompts")


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for prompts at a parallel layout")
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt text")
    src.add_argument("--prompts", metavar="FILE.jsonl", help='lines of {"id":..., "prompt": "..."} or prompt_token_ids')
    p.add_argument("--output", metavar="FILE.jsonl", help="write results here instead of stdout")
    p.add_argument("--launcher", default="auto", choices=["auto", "local", "torchrun", "ray", "mpi"],
                   help="auto: torchrun or mpirun if launched by one, else local processes")
    p.add_argument("--ray-address", default=None, help="Ray cluster to join (default: start Ray here)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_model_options(p)
    add_sampling_options(p)
    p.set_defaults(run=run)


def sampling_params(args):
    from atoll.engine.sampling import SamplingParams

    return SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=tuple(args.stop))


def make_llm(args, model_dir):
    from dataclasses import asdict

    from atoll.engine.config import from_args
    from atoll.engine.llm import LLM

    return LLM(model_dir, layout=args.layout, tensor_parallel_size=args.tensor_parallel_size,
               pipeline_parallel_size=args.pipeline_parallel_size, data_parallel_size=args.data_parallel_size,
               expert_parallel_size=args.expert_parallel_size, **asdict(from_args(args)))


def run(args) -> int:
    from atoll.engine.worker import generate_worker
    from atoll.errors import AtollError
    from atoll.launch.launchers import detect, launch
    from atoll.launch.requests import read_jsonl, write_jsonl

    llm = make_llm(args, args.model)
    if args.prompts:
        prompts, failures = read_jsonl(args.prompts)
    else:
        prompts, failures = [{"id": 0, "prompt": args.prompt}], []
    requests = llm.prepare(prompts, sampling_params(args), chat=args.chat)
    start = time.perf_counter()
    launcher = detect() if args.launcher == "auto" else args.launcher
    if launcher in ("local", "ray"):
        print(f"atoll: {len(requests)} prompts on {llm.layout} ({llm.layout.world_size} ranks, {launcher})",
              file=sys.stderr)
    bar, progress = _progress(launcher, len(requests), enabled=not args.no_progress)
    try:
        spec = llm.spec(requests)
        reports, results = launch(generate_worker, llm.layout.world_size, spec, requests, launcher=launcher,
                                  ray_address=args.ray_address, device=spec.device, progress=progress)
    except AtollError as e:
        # nothing is lost silently: every request is listed, failed, with the cause
        write_jsonl([{"id": _rid(p, i), "error": str(e)} for i, p in enumerate(prompts)] + failures, args.output)
        raise
    finally:
        if bar is not None:
            bar.close()
    if not reports:
        return 0
    elapsed = time.perf_counter() - start
    outputs = llm.finish(prompts, requests, results)
    write_jsonl([o.to_json() for o in outputs] + failures, args.output)
    tokens = sum(len(o.token_ids) for o in outputs)
    print(f"atoll: {len(outputs)} done, {len(failures)} failed, {tokens} tokens in {elapsed:.1f}s "
          f"({tokens / elapsed:.1f} tok/s)", file=sys.stderr)
    return 1 if failures else 0


def _rid(prompt, index):
    return prompt.get("id", index) if isinstance(prompt, dict) else index


def _progress(launcher: str, total: int, *, enabled: bool):
    """(bar, what the workers get): a queue for local ranks, the bar itself for rank 0 of
    torchrun/mpirun, nothing for Ray (its actors cannot reach the driver's queue)."""
    import os

    from atoll.launch.progress import ProgressBar

    if not enabled or launcher == "ray":
        return None, None
    if launcher == "local":
        import multiprocessing as mp

        channel = mp.get_context("spawn").Queue()
        bar = ProgressBar(total, channel=channel)
        return bar, channel
    if os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")) != "0":
        return None, None
    bar = ProgressBar(total)
    return bar, bar
