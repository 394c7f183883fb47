"""The `atoll plan` table (rich): best layouts, memory, TTFT, TPOT, tokens/s, what binds."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

GIB = 2**30


def _binds(p) -> str:
    if not p.fits:
        return f"short {p.memory.shortfall / GIB:.1f} GiB"
    if not p.sustainable:
        return f"overloaded: at most {p.arrival_rate:.3g} req/s"
    top = max(p.decode.items(), key=lambda kv: kv[1])[0]
    return top.replace("HBM reads of ", "HBM: ").replace(" over ", " / ")


def rows_for(plan, top: int) -> list:
    """The best `top` layouts that fit, then the best few that do not (to show shortfalls)."""
    fit = [p for p in plan.predictions if p.fits][:top]
    misfit = [p for p in plan.predictions if not p.fits][:max(0, top - len(fit))][:3]
    return fit + misfit


def print_plans(plans, *, top: int = 10, console=None) -> None:
    console = console or Console(width=140)
    first = plans[0]
    w = first.workload
    console.print(f"[bold]{first.model}[/bold] on {first.topology.describe()}")
    console.print(f"isl {w.isl}, osl {w.osl}, weights {w.dtype}, KV {w.kv_dtype}; "
                  f"{first.evaluated} layouts evaluated per concurrency")
    loop = (f"open loop, {w.request_rate:g} requests/s (Poisson)" if w.request_rate is not None
            else "closed loop (each client sends its next request when its last ends)")
    console.print(f"steady serving, {loop}: TPOT is the mean decode step with the new prompts' chunks "
                  "mixed in, TTFT includes queueing for the prefill (planner/serving.py)", highlight=False)
    if first.predictions:
        p0 = first.predictions[0]
        cal = first.topology.calibration
        where = ("measured by atoll plan --check on this topology" if cal is not None and cal.errors
                 else "the model's error against published measurements (efficiency.py)")
        console.print(f"predictions carry +-{p0.band:.0%} (TPOT, tokens/s) and +-{p0.ttft_band:.0%} (TTFT): "
                      f"{where}; '=' marks a layout tied with the recommended one", highlight=False)
    changes = []
    for plan in plans:
        c = plan.workload.concurrency
        t = Table(title=f"concurrency {c}", title_justify="left")
        for col, just in (("", "left"), ("layout", "left"), ("GPUs", "right"), ("memory GiB/GPU", "right"),
                          ("TTFT ms", "right"), ("TPOT ms", "right"), ("tok/s/GPU", "right"),
                          ("tok/s/user", "right"), ("decode bound by", "left")):
            t.add_column(col, justify=just)
        for p in rows_for(plan, top):
            mark = "*" if p is plan.recommended else ("=" if p.tie else ("" if p.meets_slo and p.sustainable
                                                                          else "slo" if p.sustainable else "!"))
            mem = f"{p.memory.used / GIB:.1f}/{p.memory.capacity / GIB:.0f}"
            style = None if p.fits else "dim"
            ttft = f"{p.ttft_s * 1e3:.0f}" if p.sustainable else "overloaded"
            t.add_row(mark, p.shown, str(p.gpus), mem, ttft, f"{p.tpot_s * 1e3:.1f}",
                      f"{p.tokens_per_s_per_gpu:.1f}", f"{p.tokens_per_s_per_user:.1f}", _binds(p), style=style)
        console.print(t)
        for r in plan.reasons:
            console.print(f"  - {r}", highlight=False, soft_wrap=True)
        if plan.placement is not None:
            pl = plan.placement
            nodes = ", ".join(f"{pl.node_names[n]}: ranks {_span(pl.ranks_on(n))}" for n in pl.nodes)
            console.print(f"  placement of {plan.recommended.name} (first replica): {nodes}", highlight=False)
        changes.append((c, plan.recommended.name if plan.recommended else "none"))
    if len(plans) > 1:
        line, prev = [], None
        for c, name in changes:
            line.append(f"{c}: {name}" + (" (changes)" if prev is not None and name != prev else ""))
            prev = name
        console.print("recommendation by concurrency: " + "; ".join(line), highlight=False)


def _span(ranks: list[int]) -> str:
    if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
    return ",".join(map(str, ranks))
