"""The planner against published measurements: run the planner (its Python API) for each entry of
tests/data/published.yaml and print predicted vs measured, their ratio and the median |error|.

    python examples/planner_vs_published.py
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import sys

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # published_metrics.py beside this file
from published_metrics import METRICS, model_name, predict  # noqa: E402

WITHIN = 0.25  # issue 35: within 1.25x either way
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
        """predicted/measured within 1.25x either way (issue 35): 0.8 .. 1.25, every metric."""
        return (1 / (1 + WITHIN), 1 + WITHIN)

    @property
    def within_band(self) -> bool:
        lo, hi = self.bounds
        return lo <= self.ratio <= hi


def load_entries(path: Path = DATA, section: str = "sourced") -> list[dict]:
    """The data file's `sourced` entries (or `unsourced`: printed, not counted)."""
    with open(path) as f:
        return yaml.safe_load(f).get(section) or []


def compare(entry: dict) -> Comparison:
    if entry["metric"] not in METRICS:
        raise ValueError(f"{entry['id']}: unknown metric {entry['metric']!r}")
    predicted, band, dtype = predict(entry)
    return Comparison(entry, predicted, band, dtype)


def _point(e: dict) -> str:
    """The operating point in a few words."""
    if "tokens_per_gpu" in e:
        return f"{e['tokens_per_gpu']} tok/GPU"
    if "batch_per_gpu" in e:
        return f"{e['batch_per_gpu']}/GPU, KV {e['kv_len']}"
    if "slo" in e:
        d = e["disagg"]
        return f"{d['x']}P{d['y']}D, SLO {e['slo']['ttft_ms']:g}/{e['slo']['tpot_ms']:g} ms"
    if e.get("request_rate"):
        return f"{e['request_rate']:g} req/s"
    return f"conc. {e['concurrency']}"


def table(comparisons: list[Comparison]) -> str:
    rows = ["| entry | model, hardware, layout | weights/KV | ISL/OSL | load | metric | measured | predicted "
            "| pred/meas | band admits | in band |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in comparisons:
        e = c.entry
        hw = f"{e['topology']} x{e['nodes']}" + (f" ({e['network']})" if e.get("network") else "")
        rows.append(f"| {e['id']} | {model_name(e)}, {hw}, {' vs '.join(e['layouts'])} | {c.dtype} | "
                    f"{e['isl']}/{e['osl']} | {_point(e)} | {e['metric']} | {e['measured']:g} | "
                    f"{c.predicted:.3g} | {c.ratio:.2f} | {c.bounds[0]:.2f}-{c.bounds[1]:.2f} | {'yes' if c.within_band else 'no (known miss)' if e.get('known_miss') else 'NO'} |")
    return "\n".join(rows)


def median_abs_error(comparisons: list[Comparison]) -> float:
    return statistics.median(abs(c.ratio - 1.0) for c in comparisons)


if __name__ == "__main__":
    cs = [compare(e) for e in load_entries()]
    print(table(cs))
    inside = sum(c.within_band for c in cs)
    print(f"\nsourced: within 1.25x {inside} of {len(cs)} ({inside / len(cs):.0%}); median |predicted/measured - 1| "
          f"{median_abs_error(cs):.0%}; median predicted/measured {statistics.median(c.ratio for c in cs):.2f}")
    loose = [compare(e) for e in load_entries(section="unsourced")]
    if loose:
        print("\nunsourced, not counted:\n")
        print(table(loose))
