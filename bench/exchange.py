"""atoll bench exchange: the MoE layer's two exchanges side by side, per rows per ep rank:
the Dispatcher's flat all_to_all (dispatch, experts, combine) against gather_combine
(comm/exchange.py: every rank's experts on every row, partial sums added).

Spawns --ep local ranks (gloo on 127.0.0.1), each with its block of --experts random experts
(hidden --hidden, intermediate --inter), and routes random rows to --topk of them. Each
iteration runs both sides on the same rows, in an order that alternates, each after a barrier;
an iteration's time is the slowest rank's, the figures are medians. Without --replicated each
rank holds its own rows (gather_combine: all_gather, experts, reduce_scatter); with it every
rank holds the same ep x rows rows, as TP-replicated tokens do (the all_to_all side routes its
1/ep share and gathers the outputs back over ep, as layers/moe.py does; gather_combine runs
the experts on all rows and all_reduces). The expert compute is inside both timings: the
gather side runs more of it (layers/moe.py Experts.weighted), which is its cost at many rows.
"""

from __future__ import annotations

import statistics
import time

import torch

from atoll.bench.harness import Run
from atoll.comm.dispatch import Dispatcher
from atoll.comm.exchange import gather_combine
from atoll.comm.gather import all_gather_rows
from atoll.comm.group import Group
from atoll.errors import ConfigError
from atoll.launch.local import run_local
from atoll.layers.moe import Experts


def add_parser(sub) -> None:
    p = sub.add_parser("exchange", help="MoE all_to_all dispatch vs gather_combine, per rows per rank",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4,8,16,32,64", help="rows per ep rank, comma-separated")
    p.add_argument("--hidden", type=int, default=128, help="hidden size (default 128)")
    p.add_argument("--inter", type=int, default=64, help="expert intermediate size (default 64)")
    p.add_argument("--experts", type=int, default=32, help="routed experts (default 32)")
    p.add_argument("--topk", type=int, default=4, help="experts per token (default 4)")
    p.add_argument("--ep", type=int, default=4, help="expert-parallel ranks to spawn (default 4)")
    p.add_argument("--replicated", action="store_true", help="every rank holds the same rows")
    p.add_argument("--iters", type=int, default=30, help="timed iterations (default 30)")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations first (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=run)


def check(args) -> dict:
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        raise ConfigError(f"--rows {args.rows!r} must be comma-separated whole numbers") from None
    if not rows or min(rows) < 1:
        raise ConfigError(f"--rows {args.rows}: every count must be at least 1")
    for name in ("hidden", "inter", "experts", "topk", "iters"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} {getattr(args, name)} must be positive")
    if args.ep < 2:
        raise ConfigError(f"--ep {args.ep}: the bench needs at least 2 ranks to move anything")
    if args.topk > args.experts:
        raise ConfigError(f"--topk {args.topk} is larger than --experts {args.experts}")
    if args.warmup < 0:
        raise ConfigError(f"--warmup {args.warmup} must be 0 or more")
    keys = ("hidden", "inter", "experts", "topk", "ep", "replicated", "iters", "warmup")
    return {k: getattr(args, k) for k in keys} | {"rows": rows}


def run(args) -> int:
    cfg = check(args)
    with Run(needs_model=False) as bench:
        result = run_local(_rank, cfg["ep"], cfg, timeout_s=590, threads=1)[0]
    bench.emit(result | {"config": cfg}, as_json=args.json, render=render)
    return 0


def render(result: dict) -> None:
    cfg = result["config"]
    print(f"ep {cfg['ep']}, {cfg['experts']} experts top-{cfg['topk']}, hidden {cfg['hidden']}, inter "
          f"{cfg['inter']}, {'replicated' if cfg['replicated'] else 'own'} rows; medians of {cfg['iters']}, ms")
    print(f"{'rows/rank':>9} {'all_to_all':>10} {'gather':>8} {'gather/a2a':>10}")
    for r in result["rows"]:
        print(f"{r['rows']:>9} {r['alltoall_ms']:>10.3f} {r['gather_ms']:>8.3f} {r['ratio']:>10.2f}")
    print(f"load average (1 min) {result['load_avg_1m'][0]:.2f} before, {result['load_avg_1m'][-1]:.2f} after, "
          f"on {result['cores']} cores")


def _rank(rank: int, world: int, cfg: dict) -> dict:
    g = Group.from_torch(name="ep")
    E, k, H = cfg["experts"], cfg["topk"], cfg["hidden"]
    disp = Dispatcher(g, E, grouped=False)
    experts = Experts(disp.local_experts, H, cfg["inter"], Group.single())
    gen = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for p in (experts.w13, experts.w2):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)

    def alltoall(x, ids, w):
        if cfg["replicated"]:  # route my 1/ep share, gather the outputs back
            share = [len(x) // world] * world
            mine = slice(rank * share[0], (rank + 1) * share[0])
            d = disp.dispatch(x[mine], ids[mine], w[mine])
            return all_gather_rows(g, disp.combine(experts(d.rows, d.row_experts()), d), share)
        d = disp.dispatch(x, ids, w)
        return disp.combine(experts(d.rows, d.row_experts()), d)

    def gather(x, ids, w):
        return gather_combine(x, ids, w, experts.weighted, g, disp.split, replicated=cfg["replicated"])

    out = []
    with torch.no_grad():
        for rows in cfg["rows"]:
            n = rows * world if cfg["replicated"] else rows
            same = torch.Generator().manual_seed(1000 + rows + (0 if cfg["replicated"] else 7 * rank))
            x = torch.randn(n, H, generator=same)
            ids = torch.rand(n, E, generator=same).topk(k, dim=1).indices
            w = torch.rand(n, k, generator=same)
            times = {"alltoall": [], "gather": []}
            for it in range(cfg["warmup"] + cfg["iters"]):
                sides = [("alltoall", alltoall), ("gather", gather)]
                for name, fn in sides[::1 if it % 2 else -1]:
                    g.barrier()
                    t0 = time.perf_counter()
                    fn(x, ids, w)
                    if it >= cfg["warmup"]:
                        times[name].append(time.perf_counter() - t0)
            every = g.all_gather(torch.tensor([times["alltoall"], times["gather"]])[None], dim=0)
            slowest = every.max(dim=0).values  # [2, iters]: the slowest rank per iteration
            a2a, gat = (statistics.median(slowest[i].tolist()) * 1e3 for i in range(2))
            out.append(dict(rows=rows, alltoall_ms=a2a, gather_ms=gat, ratio=gat / a2a))
    return {"config": cfg, "rows": out}
