"""`atoll bench serve --step-trace FILE`: the measured round's step cycles, from the trace the
server's engines write as they serve (engine/rank/trace.py), and the expert rebalances the server
made in that round (its /metrics).

A step cycle runs from the end of one tick to the end of the next: the tick and the work the rank
loop does between two ticks (a rebalance's weight moves: engine/rank/eplb.py). Only cycles ending
in a decode-only tick count: such a tick decodes sequences the tick before already held, so the
engine was busy from one to the other and the cycle holds no idle wait for requests. The longest
cycle against the median is what a rebalance every --eplb-step-interval steps costs the step it
lands on (docs/eplb.md: a rebalance should hold no step up by more than one step's time).
"""

from __future__ import annotations

import json
import os
import statistics

REBALANCES = "atoll_eplb_rebalances"


def mark(path: str) -> int:
    """The trace's size now: where the next round's ticks start."""
    return os.path.getsize(path) if os.path.exists(path) else 0


def ticks_between(path: str, start: int, end: int) -> list[dict]:
    """The trace's whole lines written between byte offsets start and end."""
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(max(0, end - start))
    return [json.loads(line) for line in data.decode("utf-8").splitlines(keepends=True)
            if line.endswith("\n") and line.strip()]


def step_cycles(ticks: list[dict]) -> dict:
    """Per engine: {cycles, median_ms, p99_ms, longest_ms, longest_over_median} of its busy
    decode step cycles (module docstring); an engine with none is left out."""
    by_engine: dict[str, list[dict]] = {}
    for t in ticks:
        if "start" in t:
            by_engine.setdefault(t["engine"], []).append(t)
    out = {}
    for engine, ts in by_engine.items():
        ts.sort(key=lambda t: t["start"])
        cycles = [(b["start"] + b["seconds"]) - (a["start"] + a["seconds"]) for a, b in zip(ts, ts[1:])
                  if b["rows"] > 0 and not b["chunk_tokens"]]
        if not cycles:
            continue
        cycles.sort()
        median = statistics.median(cycles)
        p99 = cycles[min(len(cycles) - 1, int(0.99 * len(cycles)))]
        out[engine] = {"cycles": len(cycles), "median_ms": round(median * 1e3, 3), "p99_ms": round(p99 * 1e3, 3),
                       "longest_ms": round(cycles[-1] * 1e3, 3),
                       "longest_over_median": round(cycles[-1] / median, 3) if median > 0 else None}
    return out


def rebalances(samples: dict[str, float]) -> float | None:
    """The server's expert rebalances so far (/metrics, summed over its engines), None without EPLB."""
    found = [v for k, v in samples.items() if k.split("{", 1)[0] == REBALANCES]
    return sum(found) if found else None


class Cycles:
    """The measured round's cycles: `round_start(scrape)` and `round_end(scrape)` around it,
    scrape() giving the server's /metrics samples (None: a server without them); `report()`."""

    def __init__(self, path: str):
        self.path = path
        self._start = 0
        self._rebalances: float | None = None
        self.result: dict = {}

    def round_start(self, scrape) -> None:
        self._start = mark(self.path)
        self._rebalances = rebalances(scrape())

    def round_end(self, scrape) -> None:
        self.result = {"engines": step_cycles(ticks_between(self.path, self._start, mark(self.path)))}
        after = rebalances(scrape())
        if after is not None and self._rebalances is not None:
            self.result["rebalances"] = int(after - self._rebalances)

    def report(self) -> dict:
        return self.result


def cycle_lines(r: dict) -> list[str]:
    """The report's lines for bench serve's table."""
    lines = []
    extra = f"; {r['rebalances']} expert rebalances in the round" if "rebalances" in r else ""
    for engine, c in r.get("engines", {}).items():
        lines.append(f"  {engine}: {c['cycles']} decode step cycles, median {c['median_ms']:.1f} ms, p99 "
                     f"{c['p99_ms']:.1f} ms, longest {c['longest_ms']:.1f} ms ({c['longest_over_median']}x the "
                     f"median){extra}")
    if not lines:
        lines.append(f"  step cycles: none in the trace's round{extra}")
    return lines
