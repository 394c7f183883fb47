"""atoll bench dispatch --exchange-sweep: by rows per rank, the Dispatcher's flat all_to_all
(dispatch + combine; with --hierarchical the two-level path too) against
comm.exchange.gather_combine (every rank's rows gathered, each rank's experts on all of them,
partial sums reduce-scattered back), to find the decode batch size from which the all_to_all
wins.

Same ranks, islands and simulated slow link as the rest of `atoll bench dispatch`
(bench_dispatch.py's docstring says what the simulation does): gather_combine's all_gather and
reduce_scatter over an ep group that spans islands sleep too. Experts are the identity on both
sides (each row times the sum of its local experts' weights), so the figures are the exchanges
alone; `atoll bench exchange` times them with real expert GEMMs. gloo has no reduce_scatter
(comm.group: an all_reduce, then a slice), so on CPU gather_combine's way back moves about
twice what NCCL's reduce_scatter would; the simulated link charges the reduce_scatter's bytes. Rows and
routing are drawn once per row count and rank (seed --seed); the Dispatcher keeps arrival order
(grouped=False), as the MoE layer does. Per count, each iteration runs every side once in a
rotating order after a barrier; times are medians of the slowest rank. Bytes per link class are
the Dispatcher's `bytes` and gather_combine's `counters` for one call, summed over ranks.

The switch point is the smallest count tried from which the all_to_all (flat) is faster at
that count and every larger one; none when gather_combine is still faster at the largest.
"""

from __future__ import annotations

import statistics
from collections import Counter

import torch
from rich.console import Console
from rich.table import Table

from atoll.bench.dispatch_groups import CLASSES, GROUPS, keep_freed_memory, make_groups, time_sides
from atoll.comm.dispatch import Dispatcher
from atoll.comm.exchange import gather_combine


def _sweep_rank(rank: int, world: int, cfg: dict) -> dict:
    kept_memory = not cfg["return_memory"] and keep_freed_memory()

    H, E, k = cfg["hidden"], cfg["experts"], cfg["topk"]
    islands, plain, groups = make_groups(rank, world, cfg)
    kw = dict(islands=islands, grouped=False)
    paths = {"all_to_all": Dispatcher(groups["ep"], E, **kw)}
    if cfg["hierarchical"]:
        paths["two_level"] = Dispatcher(groups["ep"], E, hierarchical=True, island_group=groups["ep_island"],
                                        rail_group=groups["ep_rail"], **kw)
    split, island_of = paths["all_to_all"].split, paths["all_to_all"].island_of

    def identity_experts(rows, local_ids, weights):
        # rows: [n, hidden]; each row times the weights of its experts on this rank
        return rows * (weights * (local_ids >= 0)).sum(1, keepdim=True).to(rows.dtype)

    out = []
    for n in cfg["sweep"]:
        gen = torch.Generator().manual_seed((cfg["seed"] * 1000 + rank) * 1000 + n)
        x = torch.randn(n, H, generator=gen)  # [rows, hidden] this rank's decode rows
        ids = torch.rand(n, E, generator=gen).topk(k, dim=1).indices
        w = torch.randn(n, k, generator=gen).softmax(dim=1)

        def through(p):
            def run_path():
                d = p.dispatch(x, ids, w)
                return p.combine(d.rows, d)
            return run_path

        def gather(counters=None):
            return gather_combine(x, ids, w, identity_experts, groups["ep"], split, replicated=False,
                                  counters=counters, island_of=island_of)

        sides = {name: through(p) for name, p in paths.items()} | {"gather": gather}
        sent = []  # [sides][class] bytes of one call
        for name, p in paths.items():
            p.reset_counters()
            sides[name]()
            sent.append([p.bytes[c] for c in CLASSES])
        counted = Counter()
        gather(counted)
        sent.append([counted[c] for c in CLASSES])
        wall, _, slept = time_sides(sides, plain, groups, cfg["warmup"], cfg["iters"])
        sent = plain.all_reduce(torch.tensor(sent, dtype=torch.float64))
        slept = plain.all_reduce(slept, op="max")
        names = list(sides)
        row = {"rows": n, "ms": {s: round(statistics.median(wall[:, j].tolist()) * 1e3, 4) for j, s in enumerate(names)},
               "bytes": {s: {c: int(sent[j, i]) for i, c in enumerate(CLASSES)} for j, s in enumerate(names)}}
        row["gather_over_all_to_all"] = round(row["ms"]["gather"] / row["ms"]["all_to_all"], 4)
        if cfg["simulated"]:
            row["delay_ms_per_iter"] = {s: {g: round(float(slept[j, i]) * 1e3, 4) for i, g in enumerate(GROUPS)}
                                        for j, s in enumerate(names)}
        out.append(row)
    if rank:
        return {}
    switch = None  # smallest count from which the all_to_all wins at every larger count tried
    for row in sorted(out, key=lambda r: r["rows"], reverse=True):
        if row["gather_over_all_to_all"] <= 1:
            break
        switch = row["rows"]
    result = {"config": cfg | {"islands": islands, "malloc_keeps_memory": kept_memory}, "sweep": out,
              "switch_to_all_to_all_at_rows": switch}
    if cfg["simulated"]:
        result["simulated_link"] = {"simulated": True, "gb_s": cfg["cross_gb_s"],
                                    "latency_us": cfg["cross_latency_us"] or 0.0}
    return result


def render_sweep(r: dict) -> None:
    c = r["config"]
    sim = r.get("simulated_link")
    title = (f"exchange sweep: hidden {c['hidden']} (float32), {c['experts']} experts top-{c['topk']}, "
             f"ep={c['ep']}, islands {c['islands']}, medians of {c['iters']}")
    if sim:
        title += f", SIMULATED link {sim['gb_s'] or 'unlimited'} GB/s + {sim['latency_us']:g} us"
    t = Table(title=title)
    sides = list(r["sweep"][0]["ms"])
    short = {"all_to_all": "a2a", "two_level": "2-level", "gather": "gather"}
    for name in ["rows/rank"] + [f"{short[s]} ms" for s in sides] + ["gather/a2a"] + \
            [f"{short[s]} cross KiB" for s in sides]:
        t.add_column(name, justify="right")
    for row in r["sweep"]:
        t.add_row(str(row["rows"]), *(f"{row['ms'][s]:.3f}" for s in sides), f"{row['gather_over_all_to_all']:.2f}",
                  *(f"{row['bytes'][s]['cross'] / 1024:.1f}" for s in sides))
    Console().print(t)
    for row in r["sweep"]:  # plain lines for logs and grep
        print(f"rows {row['rows']}: gather/all-to-all {row['gather_over_all_to_all']:.2f}; bytes intra, cross: "
              + "; ".join(f"{s} {row['bytes'][s]['intra']}, {row['bytes'][s]['cross']}" for s in sides))
    n = r["switch_to_all_to_all_at_rows"]
    counts = sorted(row["rows"] for row in r["sweep"])
    if n is None:
        print(f"gather_combine faster up to {counts[-1]} rows per rank, the largest tried")
    elif n == counts[0]:
        print(f"all_to_all faster at every count tried ({counts[0]} to {counts[-1]} rows per rank)")
    else:
        print(f"switch to all_to_all at {n} rows per rank (gather_combine faster below)")
