"""Pareto plot: tokens/s/GPU against tokens/s/user, recommended points marked (matplotlib)."""

from __future__ import annotations

from atoll.errors import ConfigError


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of points no other point beats on both x and y, ordered by x."""
    order = sorted(range(len(points)), key=lambda i: (-points[i][0], -points[i][1]))
    front, best_y = [], float("-inf")
    for i in order:
        if points[i][1] > best_y:
            front.append(i)
            best_y = points[i][1]
    return sorted(front, key=lambda i: points[i][0])


def plot_plans(plans, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'atoll[plot]'") from None
    preds = [(plan, p) for plan in plans for p in plan.predictions if p.fits]
    if not preds:
        raise ConfigError("nothing to plot: no layout fits in GPU memory")
    pts = [(p.tokens_per_s_per_user, p.tokens_per_s_per_gpu) for _, p in preds]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.scatter([x for x, _ in pts], [y for _, y in pts], s=12, c="#bbbbbb", label="layouts that fit")
    front = pareto(pts)
    ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], "-o", c="#1f77b4", ms=4,
            label="Pareto front")
    recommended = {id(plan.recommended) for plan in plans}
    xmax, ymax = max(x for x, _ in pts) or 1, max(y for _, y in pts) or 1
    labelled: list[tuple[float, float]] = []
    for i in front:  # label front points that are not recommended and not on top of a label
        plan, p = preds[i]
        x, y = pts[i]
        if id(p) in recommended or any(abs(x - a) < 0.04 * xmax and abs(y - b) < 0.04 * ymax
                                       for a, b in labelled):
            continue
        labelled.append((x, y))
        ax.annotate(f"{p.name} @{plan.workload.concurrency}", (x, y), fontsize=7,
                    xytext=(4, 4), textcoords="offset points")
    for plan in plans:
        r = plan.recommended
        if r is not None:
            ax.scatter([r.tokens_per_s_per_user], [r.tokens_per_s_per_gpu], marker="*", s=220, c="#d62728",
                       zorder=5, label="recommended" if plan is plans[0] else None)
            ax.annotate(f"{r.name} (c={plan.workload.concurrency})", (r.tokens_per_s_per_user,
                        r.tokens_per_s_per_gpu), fontsize=8, color="#d62728", xytext=(6, -12),
                        textcoords="offset points")
    first = plans[0]
    w = first.workload
    ax.set_xlabel("tokens/s per user (1 / TPOT)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(f"{first.model} on {first.topology.describe().split(';')[0]}\n"
                 f"isl {w.isl}, osl {w.osl}, {w.dtype}, concurrency "
                 f"{','.join(str(p.workload.concurrency) for p in plans)}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except (OSError, ValueError) as e:  # a path or format checked too late (the CLI checks first)
        raise ConfigError(f"--plot {path}: {getattr(e, 'strerror', None) or e}") from None
    finally:
        plt.close(fig)


def plot_frontier(result, path: str, *, title: str = "") -> None:
    """The SLO search's runs (planner/sim/search.py) that met the SLOs: output tokens/s per GPU
    against per user, the Pareto front joined and the chosen deployment starred."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'atoll[plot]'") from None
    pts = [(*t.point(j.gpus), j) for j in result.judged for t in j.trials
           if t.attainment >= result.target.attainment and t.rate != float("inf")]
    if not pts:
        raise ConfigError("nothing to plot: no simulated run met the SLOs")
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.scatter([x for x, _, _ in pts], [y for _, y, _ in pts], s=12, c="#bbbbbb", label="runs meeting the SLOs")
    front = result.frontier
    ax.plot([x for x, _, _ in front], [y for _, y, _ in front], "-o", c="#1f77b4", ms=4, label="Pareto front")
    for x, y, what in front:
        ax.annotate(what, (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")
    best = result.best
    if best is not None and best.best is not None:
        x, y = best.best.point(best.gpus)
        ax.scatter([x], [y], marker="*", s=220, c="#d62728", zorder=5, label=best.deployment.describe())
    ax.set_xlabel("output tokens/s per user (1 / mean TPOT)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(f"{title}\n{result.target.describe()}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--plot {path}: {getattr(e, 'strerror', None) or e}") from None
    finally:
        plt.close(fig)
