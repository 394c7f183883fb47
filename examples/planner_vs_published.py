"""The planner against published measurements: run the planner (its Python API) for each entry of
tests/data/published.yaml and print predicted vs measured, their ratio and the median |error|.

    python examples/planner_vs_published.py
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import yaml

from atoll.planner import Workload, plan_layouts
from atoll.topologies import load_topology
from atoll.topologies.load import with_network

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "published.yaml"


@dataclass(frozen=True)
class Comparison:
    entry: dict
    predicted: float
    band: float  # relative band the planner states for this figure
    dtype: str  # weights / KV cache precision the planner costed

    @property
    def ratio(self) -> float:
        """predicted / measured"""
        return self.predicted / self.entry["measured"]

    @property
    def bounds(self) -> tuple[float, float]:
        """predicted/measured the band admits: 1 +- band; for a ratio of two layouts, each
        carrying +-b, from (1 - b)/(1 + b) to (1 + b)/(1 - b)."""
        b = self.band
        return ((1 - b) / (1 + b), (1 + b) / (1 - b)) if self.entry["metric"] == "ratio" else (1 - b, 1 + b)

    @property
    def within_band(self) -> bool:
        lo, hi = self.bounds
        return lo <= self.ratio <= hi


def load_entries(path: Path = DATA) -> list[dict]:
    with open(path) as f:
        return yaml.safe_load(f)


def compare(entry: dict) -> Comparison:
    topo = load_topology(entry["topology"], nodes=entry["nodes"])
    if entry.get("network"):
        topo = with_network(topo, entry["network"])
    # closed loop at `concurrency` unless the entry gives an open-loop request_rate (requests/s)
    work = Workload(isl=entry["isl"], osl=entry["osl"], concurrency=entry["concurrency"],
                    request_rate=entry.get("request_rate"))
    plan = plan_layouts(entry["model"], topo, work, layouts=list(entry["layouts"]))
    by_name = {str(p.layout): p for p in plan.predictions}
    p = by_name[entry["layouts"][0]]
    metric = entry["metric"]
    dtype = f"{plan.workload.dtype}/{plan.workload.kv_dtype}"
    if metric == "tokens_per_s_per_user":
        return Comparison(entry, p.tokens_per_s_per_user, p.band, dtype)
    if metric == "tokens_per_s_per_gpu":
        return Comparison(entry, p.tokens_per_s_per_gpu, p.band, dtype)
    if metric == "tpot_ms":
        return Comparison(entry, p.tpot_s * 1e3, p.band, dtype)
    if metric == "ttft_ms":
        return Comparison(entry, p.ttft_s * 1e3, p.ttft_band, dtype)
    if metric == "ratio":  # tokens/s/GPU of layouts[0] over layouts[1]
        q = by_name[entry["layouts"][1]]
        return Comparison(entry, p.tokens_per_s_per_gpu / q.tokens_per_s_per_gpu, p.band, dtype)
    raise ValueError(f"{entry['id']}: unknown metric {metric!r}")


def table(comparisons: list[Comparison]) -> str:
    rows = ["| entry | model, hardware, layout | weights/KV | ISL/OSL | conc. | metric | measured | predicted "
            "| pred/meas | band admits | in band |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in comparisons:
        e = c.entry
        hw = f"{e['topology']} x{e['nodes']}" + (f" ({e['network']})" if e.get("network") else "")
        rows.append(f"| {e['id']} | {e['model']}, {hw}, {' vs '.join(e['layouts'])} | {c.dtype} | "
                    f"{e['isl']}/{e['osl']} | {e['concurrency']} | {e['metric']} | {e['measured']:g} | "
                    f"{c.predicted:.3g} | {c.ratio:.2f} | {c.bounds[0]:.2f}-{c.bounds[1]:.2f} | {'yes' if c.within_band else 'no (known miss)' if e.get('known_miss') else 'NO'} |")
    return "\n".join(rows)


def median_abs_error(comparisons: list[Comparison]) -> float:
    return statistics.median(abs(c.ratio - 1.0) for c in comparisons)


if __name__ == "__main__":
    cs = [compare(e) for e in load_entries()]
    print(table(cs))
    print(f"\nmedian |predicted/measured - 1| over {len(cs)} entries: {median_abs_error(cs):.0%}; "
          f"median predicted/measured {statistics.median(c.ratio for c in cs):.2f}; "
          f"within the planner's band: {sum(c.within_band for c in cs)} of {len(cs)}")
