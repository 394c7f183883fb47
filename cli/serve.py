"""atoll serve: an OpenAI-compatible HTTP server over a living engine (serve/).

The ranks start and load the weights before the port listens; /health answers 200 from then
on. Under torchrun or mpirun every rank runs this command: rank 0 serves, the others run
their engine rank until rank 0 stops them. SIGTERM (or Ctrl-C) drains: no new connections
or requests (503), requests in flight finish or, past --shutdown-timeout, end with an error;
then the ranks stop and the process exits 0.

A rank that dies, under --restart-policy on-failure (the default) and the local or Ray
launcher: the server stays up, stops what is left of the engine's ranks and starts them again
on the same resources (serve.replica_start.start_single); the requests in flight or waiting
are held and continue there with the tokens they streamed, and /health answers 503
"restarting" meanwhile. A crash loop (--max-restarts within --restart-window-s), or any death
under --restart-policy never, torchrun or mpirun (a fixed world): every request in flight ends
with an error naming the rank, /health answers 503 for DEAD_LINGER_S, and the process exits
with that one line (code 2), for a supervisor or the job's launcher to restart."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import sys
import tempfile

from atoll.cli.generate import _living_launcher, _plan, add_model_options, make_llm
from atoll.cli.main import Terminated
from atoll.cli.requests import Line
from atoll.cli.serve_replicas import (add_elastic_options, add_replica_options, check_replicas, elastic,
                                     restart_policy, take_replicas)
from atoll.engine.worker import worker
from atoll.errors import InputError, LaunchError
from atoll.launch.launchers import check_launcher, detect, is_first_rank
from atoll.models.config import ModelConfig

DEAD_LINGER_S = 2.0  # /health says 503 this long after the engine died, then the process exits
# --layout auto plans for this serving workload: max_num_seqs requests of these lengths (at
# most half and a quarter of the context)
AUTO_PROMPT_TOKENS, AUTO_OUTPUT_TOKENS = 512, 256
TOOL_CALL_PARSERS = ["hermes", "llama3_json", "deepseek_v3"]  # serve.tools.PARSERS (not imported: --help stays light)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over OpenAI-compatible HTTP (completions, chat)")
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model name(s) requests give (default: --model as given); the first is reported")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/*")
    p.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                   help='how tool_choice "auto" reads tool calls out of the model\'s text: hermes (Hermes, Qwen '
                        "<tool_call>), llama3_json (Llama 3.x JSON) or deepseek_v3 (DeepSeek-V3's tokens); "
                        '"required" and a named function need none')
    p.add_argument("--max-waiting-requests", type=int, default=1024, metavar="N",
                   help="requests waiting for their first token beyond which new ones get 429 with Retry-After")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM, seconds requests in flight get to finish before they end with an error")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (info logs every request)")
    p.add_argument("--launcher", default="auto", choices=["auto", "local", "torchrun", "ray", "mpi"],
                   help="auto: torchrun or mpirun if launched by one (rank 0 serves HTTP, the others run "
                        "their engine rank), else local processes")
    p.add_argument("--ray-address", default=None, help="Ray cluster to join (default: start Ray here)")
    p.add_argument("--plan", metavar="PLAN.yaml", default=None,
                   help="run the layout of a plan from `atoll plan --save` (instead of --layout)")
    p.add_argument("--strict-placement", action="store_true", help="as for generate (Ray, torchrun, mpirun)")
    add_model_options(p)
    add_replica_options(p)
    add_elastic_options(p)
    p.set_defaults(run=run)


def _check_args(args) -> None:
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port {args.port} must be between 0 and 65535")
    if not args.shutdown_timeout > 0:
        raise InputError(f"--shutdown-timeout {args.shutdown_timeout:g} must be a positive number of seconds")
    if args.max_waiting_requests < 1:
        raise InputError(f"--max-waiting-requests {args.max_waiting_requests} must be at least 1")
    if args.api_key is not None and not args.api_key.strip():
        raise InputError("--api-key is empty")


def _layout(args, launcher: str):
    """The plan's layout (--plan, or --layout auto for a serving workload), else None."""
    if not args.plan and str(args.layout).lower() != "auto":
        return None
    context = min(args.max_model_len or 1 << 30, ModelConfig.load(args.model).max_position_embeddings)
    args.max_new_tokens = min(AUTO_OUTPUT_TOKENS, context // 4)
    prompt = [0] * min(AUTO_PROMPT_TOKENS, context // 2)
    return _plan(args, launcher, [Line(None, i, {"prompt_token_ids": prompt}) for i in range(args.max_num_seqs)])


def _listen(host: str, port: int):
    """The server's socket, bound now: a port in use is one line before any rank starts.

    Made with its protocol named (IPPROTO_TCP), not 0: asyncio turns Nagle's algorithm off
    (TCP_NODELAY) only on accepted sockets whose protocol says TCP, and with Nagle on, every
    response on a kept-alive connection and every streamed chunk after the first waited for
    the client's delayed ACK (about 40 ms on Linux)."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
    except OSError as e:
        raise LaunchError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def run(args) -> int:
    _check_args(args)
    launcher = detect() if args.launcher == "auto" else args.launcher
    replicas = take_replicas(args, ModelConfig.load(args.model))
    plan = args.saved_plan = _layout(args, launcher)
    replicas = plan.replicas if plan else replicas
    check_replicas(replicas, launcher)
    if args.elastic_ep and (replicas > 1 or args.enable_admin_api):
        raise InputError(f"--elastic-ep runs one DPnEPn engine, not {replicas} replicas of it" if replicas > 1 else
                         "--elastic-ep runs one engine that shrinks itself: --enable-admin-api has no replicas to change")
    policy = restart_policy(args)  # its flags checked before any rank starts
    disaggregated = bool(getattr(args, "prefill", None))  # its engines are drained and serve again
    args.elastic = elastic(args, replicas, disaggregated)
    if args.enable_admin_api and replicas == 1 and not disaggregated \
            and not (policy.restarts and launcher in ("local", "ray")):
        raise InputError(f"--enable-admin-api: one engine under --restart-policy {args.restart_policy} and the "
                         f"{launcher} launcher has nothing to change; run replicas (--data-parallel-size N)")
    traces = _traces(args, replicas, launcher)
    try:
        return _run(args, launcher, replicas, plan, policy, traces)
    finally:
        if traces is not None:
            shutil.rmtree(traces, ignore_errors=True)


def _traces(args, replicas: int, launcher: str) -> str | None:
    """--autoscale and the admin API read the engines' steps: a directory of step traces the
    server makes (replica k's replica{k}.jsonl; one engine's steps.jsonl), unless --step-trace
    names the file (then every replica's ticks are counted as one engine's). Under the local
    launcher only: elsewhere an engine's first rank may write on another node (--step-trace on a
    shared file system gives the corrections there; without it the steps are predicted, uncorrected)."""
    if not (args.autoscale or args.enable_admin_api) or args.step_trace or launcher != "local":
        return None
    traces = tempfile.mkdtemp(prefix="atoll-steps-")
    if replicas == 1:
        args.step_trace = os.path.join(traces, "steps.jsonl")
    return traces


def _run(args, launcher: str, replicas: int, plan, policy, traces: str | None) -> int:
    llm = make_llm(args, args.model, layout=str(plan.layout) if plan else None)
    if llm.prefill_layout is not None and launcher not in ("local", "ray"):
        raise LaunchError(f"--prefill/--decode: disaggregated serving runs under the local or Ray launcher, "
                          f"not {launcher}")
    check_launcher(launcher, device=llm.device, world_size=llm.layout.world_size * replicas)
    args.context = llm.context_options(islands=plan.islands if plan else None, nodes=plan.nodes if plan else None)
    if launcher != "local":
        if replicas > 1 and plan is not None:  # its placement is one replica's: Ray places each
            print(f"atoll: Ray places each of the {replicas} replicas' ranks (TP inside a node); the plan's "
                  "placement names one replica's GPUs", file=sys.stderr)
            args.saved_plan = None
        llm.launcher = _living_launcher(args, llm, launcher)
        if not is_first_rank(launcher):
            return _join(args, llm)
    sock = _listen(args.host, args.port)
    engine = None
    try:
        try:
            if replicas > 1:
                from atoll.serve.replica_start import start_replicas  # lazy: prometheus_client (atoll[serve])

                engine = start_replicas(llm, replicas, parallel=args.context, router=args.router,
                                        policy=policy, traces=traces)
            elif policy.restarts and launcher in ("local", "ray"):
                from atoll.serve.replica_start import start_disagg, start_single  # lazy: as above

                engine = start_single(llm, parallel=args.context, policy=policy) if llm.prefill_layout is None \
                    else start_disagg(llm, policy=policy)
            else:
                llm.start(parallel=args.context)
        except Terminated:
            print("atoll: terminated (SIGTERM) while the ranks were starting", file=sys.stderr)
            return 0
        return _serve(args, llm, sock, engine, _predictor(args, llm, replicas, traces))
    finally:
        sock.close()
        if engine is not None:
            engine.close()
        llm.close()


def _join(args, llm) -> int:
    """torchrun/mpirun, a rank but 0: run the engine's rank until rank 0 (the server) says stop.
    The job's SIGTERM reaches every rank; this one waits for rank 0's drain instead of leaving
    the others mid-collective."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    llm.launcher.join(worker, llm.layout.world_size, None, None, None, device=llm.options.device)
    return 0


def _predictor(args, llm, replicas: int, traces: str | None):
    """The planner's step costs for --autoscale and the admin API, read against the step traces."""
    if not (args.autoscale or args.enable_admin_api):
        return None
    from atoll.serve.predict import Source, for_server  # lazy: the planner, only for these

    if traces is not None and replicas > 1:
        sources = [Source(os.path.join(traces, f"replica{k}.jsonl"), f"replica {k}", own=True) for k in range(replicas)]
    elif args.step_trace:
        sources = [Source(args.step_trace, None, own=traces is not None)]
    else:
        sources = []
    return for_server(args, llm, sources, replicas=replicas,
                      log=lambda line: print(f"atoll: {line}", file=sys.stderr, flush=True))


def _serve(args, llm, sock, engine=None, predictor=None) -> int:
    # lazy: fastapi, uvicorn and prometheus_client are the optional atoll[serve]; --help and a
    # torchrun rank but 0 need none of them
    from atoll.serve.server import serve

    names = args.served_model_name or [str(args.model)]
    disaggregated = llm.prefill_layout is not None  # its admin API needs no restarting set
    port = sock.getsockname()[1]
    ranks = llm.layout.world_size
    copies = ""
    if engine is not None:
        copies = ", restarted on failure" if engine.label else f" x {len(engine.engines)} replicas, {args.router} router"
    print(f"atoll: serving {names[0]} on http://{args.host}:{port}/v1 ({llm.layout}, {ranks} "
          f"rank{'s' if ranks > 1 else ''}{copies})", file=sys.stderr, flush=True)
    return asyncio.run(serve(llm, sock, served_names=names, api_key=args.api_key,
                             tool_call_parser=args.tool_call_parser, max_waiting=args.max_waiting_requests, shutdown_timeout=args.shutdown_timeout,
                             log_level=args.log_level, dead_linger_s=DEAD_LINGER_S, engine=engine,
                             admin_api=args.enable_admin_api and (engine is not None or disaggregated),
                             autoscale=args.elastic,
                             predictor=predictor))
