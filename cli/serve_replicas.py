"""atoll serve's replicas: how many engines of the layout to run, from the flags or the plan.

For a dense model `--data-parallel-size N` (`-dp N`, or DP in --layout) means N replicas of
the TP/PP layout: a dense model has no data parallelism inside one engine. For an MoE model
dp keeps its meaning (attention data parallelism inside the engine, its experts shared).
A saved plan's `replicas:` are run as they are, for either kind.
"""

from __future__ import annotations

from atoll.engine.batch.router import ROUTERS
from atoll.errors import InputError, LaunchError
from atoll.parallel.layout import Layout
from atoll.serve.restarts import RESTART_POLICIES, RestartPolicy

ROUTER_HELP = ("which replica takes a request: cache_aware (the one holding the longest cached prefix of its "
               "prompt, as the engines report the blocks they name and evict, else the least loaded), "
               "sent_prefix (the same rule over the router's own model of what it sent) or round_robin")


def add_replica_options(p) -> None:
    p.add_argument("--router", default="cache_aware", choices=ROUTERS, help=ROUTER_HELP)
    p.add_argument("--restart-policy", default="on-failure", choices=RESTART_POLICIES,
                   help="an engine whose ranks die is started again on the same resources (on-failure, the "
                        "default; local and Ray launchers) or left down (never). Replicas: its requests continue "
                        "on the live replicas either way, with the tokens they streamed. One engine: they are "
                        "held and continue on it once restarted; under never, or a crash loop, the server exits 2")
    p.add_argument("--max-restarts", type=int, default=3, metavar="N",
                   help="restarts of one engine within --restart-window-s before it stays down (default 3)")
    p.add_argument("--restart-window-s", type=float, default=600.0, metavar="S",
                   help="the window --max-restarts counts over (default 600)")


def add_elastic_options(p) -> None:
    p.add_argument("--enable-admin-api", action="store_true",
                   help="serve /admin/engines: list the engines, drain, remove or add one within the ranks the "
                        "server holds; a disaggregated server's prefill and decode engines are drained and "
                        "serve again (behind --api-key when given; off by default)")
    p.add_argument("--autoscale", action="store_true",
                   help="add and drain replicas (a disaggregated server: shift its local-prefill threshold, serve "
                        "drained engines again and turn engines between prefill and decode) from "
                        "the live load against --goodput, with a hysteresis (decisions logged, counted in /metrics "
                        "and listed at /admin/autoscale)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="the SLOs --autoscale aims at: ttft:MS tpot:MS")
    p.add_argument("--autoscale-interval-s", type=float, default=30.0, metavar="S",
                   help="--autoscale: at least this long between two decisions, and the window each reads "
                        "(default 30)")
    p.add_argument("--topology", default=None, metavar="NAME|YAML",
                   help="--autoscale and /admin/engines: the topology whose cost model predicts each engine's "
                        "step (a preset, or the YAML `atoll calibrate` writes, with the model's measured steps; "
                        "default local), corrected live by the measured steps")


def elastic(args, replicas: int, disaggregated: bool):
    """--autoscale's (Goodput, Policy, every_s), or None; the flags checked before any rank starts."""
    from atoll.serve.autoscale import Goodput, Policy  # lazy: as light as the rest of --help

    if args.goodput is not None and not args.autoscale:
        raise InputError("--goodput is for --autoscale")
    if args.topology is not None:
        if not (args.autoscale or args.enable_admin_api):
            raise InputError("--topology is for --autoscale and --enable-admin-api (their step predictions)")
        from atoll.topologies import load_topology  # lazy: as light as the rest of --help

        load_topology(args.topology)  # a missing or bad file: its one line before any rank starts
    if not args.autoscale:
        return None
    if args.goodput is None:
        raise InputError("--autoscale needs --goodput ttft:MS tpot:MS")
    if replicas < 2 and not disaggregated:
        raise InputError("--autoscale needs engines to add and drain: --data-parallel-size 2 or more")
    if not args.autoscale_interval_s > 0:
        raise InputError(f"--autoscale-interval-s {args.autoscale_interval_s:g} must be a positive number of seconds")
    interval = args.autoscale_interval_s
    return Goodput.parse(args.goodput), Policy(interval_s=interval, window_s=interval), max(0.5, interval / 6)


def restart_policy(args) -> RestartPolicy:
    return RestartPolicy(args.restart_policy, args.max_restarts, args.restart_window_s)


def take_replicas(args, config) -> int:
    """The replica count the flags ask for; a dense model's dp is moved out of the layout
    flags into it (args is changed so the engine's layout has dp 1)."""
    if config.is_moe or args.plan or getattr(args, "prefill", None):
        return 1  # a plan names its replicas; disaggregated: --prefill/--decode-replicas (-dp is refused)
    replicas = 1
    if args.data_parallel_size is not None:
        if args.data_parallel_size < 1:
            raise InputError(f"--data-parallel-size {args.data_parallel_size} must be at least 1")
        replicas, args.data_parallel_size = args.data_parallel_size, None
    if args.layout is not None and str(args.layout).lower() != "auto":
        layout = Layout.parse(str(args.layout))
        if layout.dp > 1:
            if replicas > 1:
                raise InputError(f"give replicas as --layout {args.layout} or --data-parallel-size, not both")
            replicas, args.layout = layout.dp, str(Layout(tp=layout.tp, pp=layout.pp))
    return replicas


def check_replicas(replicas: int, launcher: str) -> None:
    if replicas > 1 and launcher not in ("local", "ray"):
        raise LaunchError(f"{replicas} replicas run under the local or Ray launcher; under {launcher} one job "
                          "serves one engine: start one `atoll serve` per replica")
