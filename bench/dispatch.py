"""atoll bench dispatch: the MoE Dispatcher against a bare all_to_all of the same bytes, and
island-first (two-level) dispatch against flat, optionally over a simulated slow link.

Spawns --ep local ranks (gloo on 127.0.0.1) and times one MoE dispatch + combine (identity
experts) against bare all_to_alls of the same payload, on one routing; with --hierarchical
the two-level path and flat dispatch are timed side by side too, with --cross-gb-s or
--cross-latency-us over a simulated slow link between islands (a sleep, not a network).

Timing. Each iteration runs every side once (dispatcher, bare all_to_all, and with
--hierarchical flat dispatch), in an order that rotates by one each iteration, each after a
barrier. The bare side makes exactly the payload all_to_alls the dispatcher made (splits and
row widths of every leg, forward and back, over the same groups) on preallocated buffers, so
dispatcher / bare is the dispatcher's own cost on top of moving its rows: the count exchange,
the permutations, metadata and the weighted sum. An iteration's time is the slowest rank's;
ratios are of the medians. CPU seconds of all ranks are reported too: with more ranks than
free cores, wall time also measures the scheduler, CPU time only the work.

Islands are simulated: --islands N splits the ep ranks into N contiguous sets, given to
ParallelContext as each rank's island, so the two-level path runs on its real subgroups: the
cross-island leg over the "ep_rail" groups (one rank per island) and the intra-island leg over
the "ep_island" groups. Islands of unequal sizes have no rails; the hierarchical path then runs
both legs over the whole ep group with zero splits (reported as two_level false).

Bytes: the Dispatcher's `bytes` counter (every byte a rank sent: rows, packed ids and weights,
counts) and `row_bytes` (hidden-state rows only), per link class ("intra": to a rank of its own
island, "cross": to another island), for one dispatch + combine of each path (flat and, with 2
or more islands, hierarchical), summed over ranks. Next to them the analytic minimum of row
bytes any dispatcher must move (routing.min_rows, both directions): across islands one row per
(token, remote island it touches) each way, which the hierarchical path reaches.

Simulated slow link (--cross-gb-s G, --cross-latency-us U). The dispatchers' ep, ep_island
and ep_rail groups are wrapped (SlowGroup) so that every all_to_all, all_gather, all_reduce,
reduce_scatter and broadcast over a group whose members sit on more than one island sleeps,
after the collective returns, for U microseconds + B / (G * 1e9) seconds, where B is the
larger of the bytes this rank sent to and received from members on other islands in that
collective (all_to_all: its splits times the row width; all_gather: its tensor once per remote
member; reduce_scatter: 1/size of it per remote member; all_reduce: twice that). Groups inside
one island never sleep. So flat dispatch pays on each of its ep-group all_to_alls and the
two-level path on its rail legs only; the bare side pays the same on the legs it copies. The
barriers and the result exchanges of the bench itself are never delayed. Each rank's sleeps
are recorded per group and reported (the most any rank slept per iteration); the real
transfer over loopback still happens underneath, so the simulated link adds to it.

--exchange-sweep runs a different comparison on the same ranks, islands and link: the
all_to_all against comm.exchange.gather_combine by rows per rank (bench/dispatch_sweep.py).

Each rank asks glibc to keep freed memory (mallopt), as PyTorch's caching allocator does on GPU:
with glibc's defaults a freed 16 MiB buffer often goes back to the OS and the next one costs
~4000 page faults, more than the copy into it. --return-memory keeps glibc's defaults.
"""

from __future__ import annotations

import math
import statistics

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from atoll.bench.dispatch_groups import CLASSES, GROUPS, keep_freed_memory, make_groups, time_sides
from atoll.bench.dispatch_sweep import _sweep_rank, render_sweep
from atoll.bench.harness import Run
from atoll.comm.dispatch import Dispatcher
from atoll.comm.routing import min_rows
from atoll.errors import ConfigError
from atoll.launch.local import run_local

SWEEP_ROWS = "1,2,4,8,16,32,64"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "dispatch", help="MoE dispatch+combine time over a bare all_to_all of the same bytes",
        description=__doc__.split("\n\n")[1])
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank (default 1024)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024)")
    p.add_argument("--experts", type=int, default=16, help="routed experts (default 16)")
    p.add_argument("--topk", type=int, default=4, help="experts per token (default 4)")
    p.add_argument("--ep", type=int, default=4, help="expert-parallel ranks to spawn (default 4)")
    p.add_argument("--hierarchical", action="store_true",
                   help="island-first (two-level) dispatch, timed against flat dispatch too")
    p.add_argument("--islands", type=int, default=None,
                   help="simulated islands over the ep ranks (default 1; 2 with --hierarchical)")
    p.add_argument("--cross-gb-s", type=float, default=None, metavar="G",
                   help="simulate a G GB/s (1e9 bytes/s) link between islands: collectives over "
                        "groups that span islands sleep for their cross-island bytes / G")
    p.add_argument("--cross-latency-us", type=float, default=None, metavar="U",
                   help="simulated latency added to every collective over a group that spans islands")
    p.add_argument("--exchange-sweep", nargs="?", const=SWEEP_ROWS, default=None, metavar="ROWS",
                   help="instead: flat dispatch + combine (and the two-level path with --hierarchical) "
                        "against comm.exchange.gather_combine at these rows per rank (comma-separated, "
                        f"default {SWEEP_ROWS}), and the count from which the all_to_all wins")
    p.add_argument("--arrival-order", action="store_true",
                   help="leave rows in arrival order (Dispatcher grouped=False): no expert-major copy")
    p.add_argument("--capacity-factor", type=float, default=None, help="drop beyond this capacity")
    p.add_argument("--iters", type=int, default=30, help="timed iterations (default 30)")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations first (default 3)")
    p.add_argument("--seed", type=int, default=0, help="routing seed (default 0)")
    p.add_argument("--return-memory", action="store_true",
                   help="leave glibc's malloc defaults (freed buffers go back to the OS)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=run)


def check(args) -> dict:
    """The options as a plain dict for the ranks; one clear line for each bad one."""
    if args.islands is None:
        args.islands = 2 if args.hierarchical else 1
    for name in ("tokens", "hidden", "experts", "topk", "ep", "iters"):
        if getattr(args, name) < (0 if name == "tokens" else 1):
            raise ConfigError(f"--{name} {getattr(args, name)} must be positive")
    if args.warmup < 0:
        raise ConfigError(f"--warmup {args.warmup} must be 0 or more")
    if args.topk > args.experts:
        raise ConfigError(f"--topk {args.topk} is larger than --experts {args.experts}")
    if args.ep < 2:
        raise ConfigError(f"--ep {args.ep}: the bench needs at least 2 ranks to move anything")
    if not 1 <= args.islands <= args.ep:
        raise ConfigError(f"--islands {args.islands} must be between 1 and --ep {args.ep}")
    if args.hierarchical and args.islands < 2:
        raise ConfigError("--hierarchical needs --islands 2 or more")
    if args.capacity_factor is not None and not args.capacity_factor > 0:
        raise ConfigError(f"--capacity-factor {args.capacity_factor} must be positive")
    if args.cross_gb_s is not None and not (0 < args.cross_gb_s < math.inf):
        raise ConfigError(f"--cross-gb-s {args.cross_gb_s} must be a positive number of GB/s")
    if args.cross_latency_us is not None and not (0 <= args.cross_latency_us < math.inf):
        raise ConfigError(f"--cross-latency-us {args.cross_latency_us} must be 0 or more")
    simulated = args.cross_gb_s is not None or args.cross_latency_us is not None
    if simulated and args.islands < 2:
        raise ConfigError("--cross-gb-s and --cross-latency-us need --islands 2 or more "
                          "(with one island nothing crosses the simulated link)")
    sweep = None
    if args.exchange_sweep is not None:
        try:
            sweep = [int(n) for n in args.exchange_sweep.split(",")]
        except ValueError:
            raise ConfigError(f"--exchange-sweep {args.exchange_sweep!r} must be comma-separated row counts") from None
        if min(sweep) < 1:
            raise ConfigError(f"--exchange-sweep {args.exchange_sweep}: every row count must be at least 1")
        if args.capacity_factor is not None:
            raise ConfigError("--exchange-sweep compares dropless exchanges: --capacity-factor does not apply")
    keys = ("tokens", "hidden", "experts", "topk", "ep", "hierarchical", "islands", "arrival_order",
            "capacity_factor", "iters", "warmup", "seed", "return_memory", "cross_gb_s", "cross_latency_us")
    return {k: getattr(args, k) for k in keys} | {"simulated": simulated, "sweep": sweep}


def run(args) -> int:
    cfg = check(args)
    with Run(needs_model=False) as bench:
        result = run_local(_sweep_rank if cfg["sweep"] else _rank, cfg["ep"], cfg, timeout_s=590)[0]
    bench.emit(result, as_json=args.json, render=render_sweep if cfg["sweep"] else render)
    return 0


def _rank(rank: int, world: int, cfg: dict) -> dict:
    kept_memory = not cfg["return_memory"] and keep_freed_memory()

    T, H, E, k = cfg["tokens"], cfg["hidden"], cfg["experts"], cfg["topk"]
    islands, plain, groups = make_groups(rank, world, cfg)
    gen = torch.Generator().manual_seed(cfg["seed"] * 1000 + rank)
    x = torch.randn(T, H, generator=gen)  # [tokens, hidden] this rank's tokens
    ids = torch.rand(T, E, generator=gen).topk(k, dim=1).indices  # k distinct experts, uniform
    w = torch.randn(T, k, generator=gen).softmax(dim=1)
    kw = dict(islands=islands, capacity_factor=cfg["capacity_factor"], grouped=not cfg["arrival_order"])
    paths = {"flat": Dispatcher(groups["ep"], E, **kw)}
    if cfg["islands"] > 1:
        paths["hierarchical"] = Dispatcher(groups["ep"], E, hierarchical=True, island_group=groups["ep_island"],
                                           rail_group=groups["ep_rail"], **kw)
    main = "hierarchical" if cfg["hierarchical"] else "flat"
    disp = paths[main]

    sent = {}  # path -> [class][all bytes, row bytes] of one dispatch + combine
    for name, p in paths.items():
        p.reset_counters()
        d = p.dispatch(x, ids, w)
        p.combine(d.rows, d)
        sent[name] = [[p.bytes[c], p.row_bytes[c]] for c in CLASSES]
        if p is disp:
            main_d = d
    kept = ids if cfg["capacity_factor"] is None else disp._drop(ids)[0]  # the pairs that move
    least = min_rows(kept, disp.split, disp.island_of, rank)

    # the bare baseline: the same payload all_to_alls over the same groups, out and back,
    # on preallocated buffers (legs over a group of one rank move nothing)
    bare, hb = [], H * x.element_size()
    for leg in main_d.legs:
        if leg.group.size == 1:
            continue
        n_out, n_in = sum(leg.send_splits), sum(leg.recv_splits)
        bare.append((leg.group, torch.zeros(n_out, leg.row_bytes, dtype=torch.uint8),
                     torch.empty(n_in, leg.row_bytes, dtype=torch.uint8), leg.recv_splits, leg.send_splits))
        bare.append((leg.group, torch.zeros(n_in, hb, dtype=torch.uint8),
                     torch.empty(n_out, hb, dtype=torch.uint8), leg.send_splits, leg.recv_splits))
    order = bare[0::2] + bare[1::2][::-1]  # legs forward, then back in reverse, like combine

    def run_bare():
        for grp, src, out, recv_splits, send_splits in order:
            dist.all_to_all_single(out, src, output_split_sizes=recv_splits,
                                   input_split_sizes=send_splits, group=grp.pg)
            if cfg["simulated"]:
                grp.pause(grp.across(send_splits, src.shape[1]), grp.across(recv_splits, src.shape[1]))

    def runner(p):
        def run_path():
            dd = p.dispatch(x, ids, w)
            p.combine(dd.rows, dd)
        return run_path

    sides = {main: runner(disp), "bare": run_bare}
    if cfg["hierarchical"]:
        sides["flat"] = runner(paths["flat"])
    wall, cpu, slept = time_sides(sides, plain, groups, cfg["warmup"], cfg["iters"])

    totals = plain.all_reduce(torch.tensor([sent.get(p, [[0, 0]] * 2) for p in ("flat", "hierarchical")] +
                                           [[[2 * least[c] * hb, 0] for c in CLASSES]], dtype=torch.float64))
    slept = plain.all_reduce(slept, op="max")  # [sides, groups] the most any rank slept per iteration
    load = torch.zeros(E, dtype=torch.float64)  # [E] rows each expert received
    mine = disp.local_experts
    load[mine.start:mine.stop] = torch.tensor(main_d.expert_counts, dtype=torch.float64)
    load = plain.all_reduce(load)
    two_level = bool(plain.all_reduce(torch.tensor([float("hierarchical" in paths and paths["hierarchical"].two_level)]),
                                      op="min"))
    if rank:
        return {}
    return report(cfg, sides, wall, cpu, slept, totals, load, two_level,
                  {"islands": islands, "dtype": str(x.dtype).removeprefix("torch."), "malloc_keeps_memory": kept_memory})


def report(cfg, sides, wall, cpu, slept, totals, load, two_level, extra) -> dict:
    names = list(sides)
    ms = {n: round(statistics.median(wall[:, j].tolist()) * 1e3, 3) for j, n in enumerate(names)}
    cpu_ms = {n: round(statistics.median(cpu[:, j].tolist()) * 1e3, 3) for j, n in enumerate(names)}
    main = names[0]
    out = {"config": cfg | extra,
           "dispatch_combine_ms": ms[main], "all_to_all_ms": ms["bare"], "ratio": round(ms[main] / ms["bare"], 4),
           "cpu_ms": {"dispatch_combine": cpu_ms[main], "all_to_all": cpu_ms["bare"],
                      "ratio": round(cpu_ms[main] / cpu_ms["bare"], 4)}}
    paths = ("flat", "hierarchical") if cfg["islands"] > 1 else ("flat",)
    out["bytes"] = {p: {c: {"sent": int(totals[i, j, 0]), "rows": int(totals[i, j, 1])} for j, c in enumerate(CLASSES)}
                    for i, p in enumerate(paths)}
    out["min_row_bytes"] = {c: int(totals[2, j, 0]) for j, c in enumerate(CLASSES)}
    if len(paths) == 2:
        f, h = out["bytes"]["flat"]["cross"], out["bytes"]["hierarchical"]["cross"]
        out["two_level"] = two_level
        out["cross_saving"] = round(1 - h["rows"] / f["rows"], 4) if f["rows"] else 0.0
        out["cross_bytes_hierarchical_over_flat"] = round(h["sent"] / f["sent"], 4) if f["sent"] else None
    if cfg["hierarchical"]:
        out["flat_ms"] = ms["flat"]
        out["hierarchical_over_flat"] = round(ms["hierarchical"] / ms["flat"], 4)
    if cfg["simulated"]:
        out["simulated_link"] = {
            "simulated": True, "gb_s": cfg["cross_gb_s"], "latency_us": cfg["cross_latency_us"] or 0.0,
            "what": "a sleep after each collective over a group spanning islands: latency + "
                    "max(cross-island bytes sent, received) / bandwidth; the data still moves over loopback",
            "delay_ms_per_iter": {n: {g: round(float(slept[j, i]) * 1e3, 4) for i, g in enumerate(GROUPS)}
                                  for j, n in enumerate(names)}}
        if cfg["hierarchical"]:
            total = {n: sum(v.values()) for n, v in out["simulated_link"]["delay_ms_per_iter"].items()}
            out["simulated_link"]["delay_hierarchical_over_flat"] = \
                round(total["hierarchical"] / total["flat"], 4) if total["flat"] else None
    out["load_imbalance"] = round(float(load.max() / load.mean()), 4) if load.sum() else None
    return out


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def render(r: dict) -> None:
    c = r["config"]
    console = Console()
    mode = "hierarchical" if c["hierarchical"] else "flat"
    mode += ", arrival order" if c["arrival_order"] else ""
    title = (f"dispatch {mode}: {c['tokens']} tokens/rank x hidden {c['hidden']} ({c['dtype']}), "
             f"{c['experts']} experts top-{c['topk']}, ep={c['ep']}, islands {c['islands']}")
    t = Table(title=title)
    t.add_column("measure")
    t.add_column("value", justify="right")
    sim = r.get("simulated_link")
    if sim:
        t.add_row("SIMULATED slow link between islands (a sleep per collective)",
                  f"{sim['gb_s'] or 'unlimited'} GB/s, {sim['latency_us']:g} us")
    t.add_row("dispatch + combine (median of slowest rank)", f"{r['dispatch_combine_ms']:.2f} ms")
    t.add_row("bare all_to_all, same payload splits", f"{r['all_to_all_ms']:.2f} ms")
    t.add_row("ratio", f"{r['ratio']:.2f}")
    cpu = r["cpu_ms"]
    t.add_row("CPU time, all ranks: dispatcher / bare (ratio)",
              f"{cpu['dispatch_combine']:.1f} / {cpu['all_to_all']:.1f} ms ({cpu['ratio']:.2f})")
    if "flat_ms" in r:
        t.add_row("flat dispatch + combine, same run", f"{r['flat_ms']:.2f} ms")
        t.add_row("hierarchical / flat time", f"{r['hierarchical_over_flat']:.2f}")
    least = r["min_row_bytes"]
    for path, by in r["bytes"].items():
        for link, b in by.items():
            floor = f" (minimum {_mb(least[link])})" if path == "hierarchical" and link == "cross" else ""
            t.add_row(f"{path}: {link}-island bytes, all / rows", f"{_mb(b['sent'])} / {_mb(b['rows'])}{floor}")
    if "cross_saving" in r:
        t.add_row("cross-island rows saved by hierarchical", f"{r['cross_saving']:.0%}")
    if sim:
        for side, by in sim["delay_ms_per_iter"].items():
            t.add_row(f"simulated delay per iteration, {side}",
                      ", ".join(f"{g} {v:.2f} ms" for g, v in by.items() if v) or "none")
    if r["load_imbalance"] is not None:
        t.add_row("expert load imbalance (max / mean rows)", f"{r['load_imbalance']:.2f}")
    console.print(t)
    for path, by in r["bytes"].items():  # one plain line per path, for logs and grep
        line = ", ".join(f"{link} {b['sent']} (rows {b['rows']})" for link, b in by.items())
        if path == "hierarchical":
            line += f"; cross rows minimum {least['cross']}"
        print(f"bytes sent, all ranks, {path}: {line}")
    if sim:
        print(f"SIMULATED slow link between islands: {sim['gb_s'] or 'unlimited'} GB/s + {sim['latency_us']:g} us, "
              "a sleep after each collective over a group spanning islands")
    print(f"dispatch/all-to-all ratio: {r['ratio']:.2f}")
    if "hierarchical_over_flat" in r:
        what = "no simulated link: the second leg's overhead"
        if sim:
            delay = sim["delay_hierarchical_over_flat"]
            what = "simulated slow link" + (f", simulated delay ratio {delay:.2f}" if delay is not None else "")
        print(f"hierarchical/flat time ratio: {r['hierarchical_over_flat']:.2f} "
              f"(cross bytes ratio {r['cross_bytes_hierarchical_over_flat']:.2f}; {what})")
