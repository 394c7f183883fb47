"""atoll bench dispatch: the MoE Dispatcher against a bare all_to_all of the same bytes.

Spawns --ep local ranks (gloo on 127.0.0.1). Each iteration times dispatch + combine (identity
experts) and, interleaved in the same run, bare `all_to_all_single` calls with exactly the
splits and row widths the dispatcher's payload all_to_alls used (forward and back, every leg);
the order of the two alternates. An iteration's time is the slowest rank's; the ratio is of the
medians. So the ratio is the dispatcher's own cost on top of moving its rows: the count
exchange, the permutations, metadata and the weighted sum. CPU seconds of all ranks are
reported per side too: with more ranks than free cores, wall time also measures the scheduler,
CPU time only the work.

Each rank asks glibc to keep freed memory (mallopt), as PyTorch's caching allocator does on GPU:
with glibc's defaults a freed 16 MiB buffer often goes back to the OS and the next one costs
~4000 page faults, more than the copy into it. --return-memory keeps glibc's defaults.

Bytes are summed over ranks for one dispatch + combine, per link class (islands are simulated
here: --islands N splits the ep ranks into N contiguous sets), against the minimum any
dispatcher needs (routing.min_rows, both directions).
"""

from __future__ import annotations

import json
import statistics
import time

from atoll.errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "dispatch", help="MoE dispatch+combine time over a bare all_to_all of the same bytes",
        description=__doc__.split("\n\n")[1])
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank (default 1024)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024)")
    p.add_argument("--experts", type=int, default=16, help="routed experts (default 16)")
    p.add_argument("--topk", type=int, default=4, help="experts per token (default 4)")
    p.add_argument("--ep", type=int, default=4, help="expert-parallel ranks to spawn (default 4)")
    p.add_argument("--hierarchical", action="store_true", help="island-first dispatch")
    p.add_argument("--islands", type=int, default=None,
                   help="simulated islands over the ep ranks (default 1; 2 with --hierarchical)")
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
    keys = ("tokens", "hidden", "experts", "topk", "ep", "hierarchical", "islands", "arrival_order",
            "capacity_factor", "iters", "warmup", "seed", "return_memory")
    return {k: getattr(args, k) for k in keys}


def run(args) -> int:
    from atoll.launch.local import run_local

    cfg = check(args)
    result = run_local(_rank, cfg["ep"], cfg, timeout_s=590)[0]
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        render(result)
    return 0


def island_sets(ep: int, n: int) -> list[list[int]]:
    """n contiguous islands over ep ranks, sizes as even as possible."""
    from atoll.comm.routing import expert_split, expert_starts

    sizes = expert_split(ep, n)
    return [list(range(s, s + m)) for s, m in zip(expert_starts(sizes), sizes)]


def keep_freed_memory() -> bool:
    """glibc: serve buffers up to 32 MiB from the heap and never trim it. False elsewhere."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
        return bool(libc.mallopt(m_mmap_threshold, 32 << 20) and libc.mallopt(m_trim_threshold, 1 << 30)
                    and libc.mallopt(m_top_pad, 64 << 20))
    except (OSError, AttributeError):
        return False


def _rank(rank: int, world: int, cfg: dict) -> dict:
    kept_memory = not cfg["return_memory"] and keep_freed_memory()
    import torch
    import torch.distributed as dist

    from atoll.comm.dispatch import Dispatcher
    from atoll.comm.group import Group
    from atoll.comm.routing import min_rows

    g = Group.from_torch(name="ep")
    T, H, E, k = cfg["tokens"], cfg["hidden"], cfg["experts"], cfg["topk"]
    gen = torch.Generator().manual_seed(cfg["seed"] * 1000 + rank)
    x = torch.randn(T, H, generator=gen)  # [tokens, hidden] this rank's tokens
    ids = torch.rand(T, E, generator=gen).topk(k, dim=1).indices  # k distinct experts, uniform
    w = torch.randn(T, k, generator=gen).softmax(dim=1)
    islands = island_sets(world, cfg["islands"])
    kw = dict(islands=islands, capacity_factor=cfg["capacity_factor"])
    disp = Dispatcher(g, E, hierarchical=cfg["hierarchical"], grouped=not cfg["arrival_order"], **kw)

    def bytes_of(d_: Dispatcher) -> tuple:
        d = d_.dispatch(x, ids, w)
        d_.combine(d.rows, d)
        return d, dict(d_.bytes), dict(d_.row_bytes)

    d, sent, rows = bytes_of(disp)
    flat = rows if not cfg["hierarchical"] else bytes_of(Dispatcher(g, E, **kw))[2]
    hier = rows if cfg["hierarchical"] or cfg["islands"] < 2 else \
        bytes_of(Dispatcher(g, E, hierarchical=True, **kw))[2]
    kept = ids if cfg["capacity_factor"] is None else disp._drop(ids)[0]  # the pairs that move
    least = min_rows(kept, disp.split, disp.island_of, rank)

    # the bare baseline: the same payload all_to_alls, out and back, on preallocated buffers
    bare, hb = [], H * x.element_size()
    for leg in d.legs:
        n_out, n_in = sum(leg.send_splits), sum(leg.recv_splits)
        bare.append((torch.zeros(n_out, leg.row_bytes, dtype=torch.uint8),
                     torch.empty(n_in, leg.row_bytes, dtype=torch.uint8), leg.recv_splits, leg.send_splits))
        bare.append((torch.zeros(n_in, hb, dtype=torch.uint8),
                     torch.empty(n_out, hb, dtype=torch.uint8), leg.send_splits, leg.recv_splits))
    order = bare[0::2] + bare[1::2][::-1]  # legs forward, then back in reverse, like combine

    def run_bare():
        for src, out, recv_splits, send_splits in order:
            dist.all_to_all_single(out, src, output_split_sizes=recv_splits,
                                   input_split_sizes=send_splits, group=g.pg)

    def run_disp():
        dd = disp.dispatch(x, ids, w)
        disp.combine(dd.rows, dd)

    times = []  # per iteration: [dispatcher wall, bare wall, dispatcher cpu, bare cpu]
    for i in range(cfg["warmup"] + cfg["iters"]):
        wall, cpu = {}, {}
        for fn in ((run_disp, run_bare) if i % 2 else (run_bare, run_disp)):
            g.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[fn], cpu[fn] = time.perf_counter() - t0, time.process_time() - c0
        if i >= cfg["warmup"]:
            times.append([wall[run_disp], wall[run_bare], cpu[run_disp], cpu[run_bare]])
    every = g.all_gather(torch.tensor(times, dtype=torch.float64)[None], dim=0)  # [ep, iters, 4]
    slowest = every[..., :2].amax(dim=0)  # an iteration lasts as long as its slowest rank
    cpu_all = every[..., 2:].sum(dim=0)   # CPU seconds of all ranks (all threads) together

    totals = torch.tensor([[sent.get(c, 0), rows.get(c, 0), least[c], flat.get(c, 0), hier.get(c, 0)]
                           for c in ("intra", "cross")], dtype=torch.float64)
    totals = g.all_reduce(totals)
    load = torch.zeros(E, dtype=torch.float64)  # [E] rows each expert received
    mine = disp.local_experts
    load[mine.start:mine.stop] = torch.tensor(d.expert_counts, dtype=torch.float64)
    load = g.all_reduce(load)
    if rank:
        return {}
    disp_s, bare_s = (statistics.median(slowest[:, j].tolist()) for j in (0, 1))
    disp_c, bare_c = (statistics.median(cpu_all[:, j].tolist()) for j in (0, 1))
    link = {c: {"sent": int(totals[i, 0]), "rows": int(totals[i, 1]), "min": int(2 * totals[i, 2] * hb)}
            for i, c in enumerate(("intra", "cross"))}
    out = {"config": cfg | {"islands": islands, "dtype": str(x.dtype).removeprefix("torch."),
                            "malloc_keeps_memory": kept_memory},
           "dispatch_combine_ms": round(disp_s * 1e3, 3), "all_to_all_ms": round(bare_s * 1e3, 3),
           "ratio": round(disp_s / bare_s, 4), "bytes": link,
           "cpu_ms": {"dispatch_combine": round(disp_c * 1e3, 3), "all_to_all": round(bare_c * 1e3, 3),
                      "ratio": round(disp_c / bare_c, 4)},
           "load_imbalance": round(float(load.max() / load.mean()), 4) if load.sum() else None}
    if cfg["islands"] > 1:
        f, h = int(totals[1, 3]), int(totals[1, 4])
        out["cross_rows"] = {"flat": f, "hierarchical": h, "saving": round(1 - h / f, 4) if f else 0.0}
    return out


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def render(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    c = r["config"]
    console = Console()
    mode = "hierarchical" if c["hierarchical"] else "flat"
    mode += ", arrival order" if c["arrival_order"] else ""
    title = (f"dispatch {mode}: {c['tokens']} tokens/rank x hidden {c['hidden']} ({c['dtype']}), "
             f"{c['experts']} experts top-{c['topk']}, ep={c['ep']}, islands {c['islands']}")
    t = Table(title=title)
    t.add_column("measure")
    t.add_column("value", justify="right")
    t.add_row("dispatch + combine (median of slowest rank)", f"{r['dispatch_combine_ms']:.2f} ms")
    t.add_row("bare all_to_all, same payload splits", f"{r['all_to_all_ms']:.2f} ms")
    t.add_row("ratio", f"{r['ratio']:.2f}")
    cpu = r["cpu_ms"]
    t.add_row("CPU time, all ranks: dispatcher / bare (ratio)",
              f"{cpu['dispatch_combine']:.1f} / {cpu['all_to_all']:.1f} ms ({cpu['ratio']:.2f})")
    for link, b in r["bytes"].items():
        t.add_row(f"{link}-island bytes: rows / all / minimum",
                  f"{_mb(b['rows'])} / {_mb(b['sent'])} / {_mb(b['min'])}")
    if "cross_rows" in r:
        x = r["cross_rows"]
        t.add_row("cross-island rows: flat / hierarchical",
                  f"{_mb(x['flat'])} / {_mb(x['hierarchical'])} (saving {x['saving']:.0%})")
    if r["load_imbalance"] is not None:
        t.add_row("expert load imbalance (max / mean rows)", f"{r['load_imbalance']:.2f}")
    console.print(t)
    print(f"dispatch/all-to-all ratio: {r['ratio']:.2f}")
