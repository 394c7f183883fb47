"""`--step-trace FILE`: each engine's first rank appends every tick's shape and seconds to FILE,
a JSON line a tick, as the rank loop times it (EngineCore's trace): what `atoll calibrate
--steps` fits the simulator's step from, measured in the engine as it serves.

    {"engine": "decode engine 0", "rows": 8, "chunk_tokens": 64, "ctx_sum": 1210,
     "attended_sum": 2080, "ctx_padded": 2048, "seconds": 0.0713, "graph": false}

start: the tick's start on the rank's clock (time.perf_counter), so the gaps between ticks show.
graph: whether the tick ran the compiled (or captured) decode step, whose attention reads every
row's keys up to the longest row's, padded (ctx_padded), where the eager step reads ctx_sum.
"""

from __future__ import annotations

import json


class StepTrace:
    """A list-like sink for EngineCore's trace that writes each (StepShape, seconds, graph) as it comes."""

    def __init__(self, path: str, engine: str | None):
        self.engine = engine or "engine"
        self.file = open(path, "a", buffering=1, encoding="utf-8")  # a line each, flushed as written

    def append(self, item) -> None:
        shape, seconds, graphed, start = item
        self.file.write(json.dumps({"engine": self.engine, "rows": shape.rows, "chunk_tokens": shape.chunk_tokens,
                                    "ctx_sum": shape.ctx_sum, "attended_sum": shape.attended_sum,
                                    "ctx_padded": shape.ctx_padded, "seconds": round(seconds, 7),
                                    "graph": graphed, "start": round(start, 6)}) + "\n")


def read_trace(path) -> list[tuple[str, int, int, float, float, float, float, bool | None]]:
    """(engine, rows, chunk tokens, ctx_sum, attended_sum, seconds, ctx_padded, graph) of every
    tick in a trace file; a trace written before the last two were: ctx_sum and None."""
    return read_ticks(path)


def read_ticks(path, start: int = 0, end: int | None = None) -> list:
    """read_trace's ticks written between byte offsets start and end (default: the file's end); a
    line still being written at the end is left for the next read."""
    out = []
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read() if end is None else f.read(max(0, end - start))
    for line in data.decode("utf-8").splitlines(keepends=True):
        if not line.endswith("\n") or not line.strip():
            continue
        d = json.loads(line)
        out.append((d["engine"], d["rows"], d["chunk_tokens"], d["ctx_sum"], d["attended_sum"], d["seconds"],
                    d.get("ctx_padded", d["ctx_sum"]), d.get("graph")))
    return out
