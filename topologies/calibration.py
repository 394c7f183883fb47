"""Calibration: figures `atoll calibrate` measured on a machine, kept in its topology YAML
under `calibration:` and read by the planner's cost model in place of assumed constants.

    calibration:
      device: cpu                 # what ran: cpu (gloo, one rank per core) or cuda (nccl, one rank per GPU)
      cores: 2                    # CPU cores of the machine (ranks beyond them share cores)
      how: "..."                  # the command, torch version, threads per rank, load average
      gemm_tflops:                # one rank: y = x @ w.T, x [rows, k], by dtype then rows
        fp32: {1: 0.004, 16: 0.05, 256: 0.09}
      memory_gb_s: {1: 11.2, 2: 7.9}   # read bandwidth per rank, with 1, 2, ... ranks reading at once
      cpu_share: {1: 1.0, 2: 0.8}      # a rank's GEMM rate with n ranks computing at once, over one alone
      overhead_us:                # a decode step of the runtime beyond its FLOP/byte floor
        step: 350                 # per tick, whatever the model (scheduler, sampler, metadata)
        per_seq: 20               # per sequence in the tick
        dense_layer: 60           # per decoder layer with a dense MLP
        seq_layer: 3              # per sequence in each decoder layer (optional)
        moe_layer: 160            # per decoder layer with routed experts
      collectives:                # seconds = latency_us + bytes / gb_s, by op then group size
        all_reduce: {2: {latency_us: 60, gb_s: 1.5}}
      errors: {tpot: 0.12, ttft: 0.3}  # `atoll plan --check --record`: the model's median |error| here

On a GPU node (device cuda) gemm_tflops holds fp32, bf16 and, where torch._scaled_mm runs
there, fp8; memory_gb_s is one GPU's HBM read bandwidth; cpu_share is absent (each rank has
its own GPU); overhead_us is the eager step, recorded but not costed (planner/runtime_terms.py);
collectives are NCCL's, absent on a single GPU.

Every number must be finite and positive (overheads may be 0); a missing entry falls back to
the topology's links and the sourced constants of planner/efficiency.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from atoll.errors import ConfigError

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
OVERHEADS = ("step", "per_seq", "dense_layer", "moe_layer", "seq_layer")


def _num(v, where: str, *, zero_ok: bool = False) -> float:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (v >= 0 if zero_ok else v > 0)
    if not ok:
        raise ConfigError(f"{where}={v!r} must be a {'non-negative' if zero_ok else 'positive'} number")
    return float(v)


def _int_key(k, where: str) -> int:
    try:
        n = int(k)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: key {k!r} must be a whole number") from None
    if n < 1 or str(n) != str(k).strip():
        raise ConfigError(f"{where}: key {k!r} must be a whole number >= 1")
    return n


def _table(d, where: str) -> dict[int, float]:
    if not isinstance(d, dict) or not d:
        raise ConfigError(f"{where} must be a non-empty mapping of whole numbers to numbers")
    return {_int_key(k, where): _num(v, f"{where}.{k}") for k, v in d.items()}


@dataclass(frozen=True)
class Calibration:
    device: str = "cpu"
    cores: int = 1
    how: str = ""
    gemm_tflops: dict = field(default_factory=dict)  # dtype -> {rows: TFLOP/s}
    memory_gb_s: dict = field(default_factory=dict)  # ranks reading at once -> GB/s per rank
    overhead_us: dict = field(default_factory=dict)  # OVERHEADS -> microseconds
    collectives: dict = field(default_factory=dict)  # op -> {size: (latency s, bytes/s)}
    errors: dict = field(default_factory=dict)  # tpot, ttft: median |predicted/measured - 1| of `plan --check`
    cpu_share: dict = field(default_factory=dict)  # ranks at once -> a rank's compute over one rank alone
    # model -> layout -> a fitted engine step (planner/sim/stepfit.py reads it): `atoll calibrate --steps`
    steps: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d, where: str = "calibration") -> "Calibration":
        if not isinstance(d, dict):
            raise ConfigError(f"{where} must be a mapping")
        unknown = set(d) - {"device", "cores", "how", "when", "host", "gemm_tflops", "memory_gb_s",
                            "overhead_us", "collectives", "load_avg_1m", "seconds", "errors", "cpu_share", "steps"}
        if unknown:
            raise ConfigError(f"{where}: unknown field '{sorted(unknown)[0]}'")
        device = d.get("device", "cpu")
        if device not in ("cpu", "cuda"):
            raise ConfigError(f"{where}.device={device!r} must be cpu or cuda")
        cores = d.get("cores", 1)
        if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
            raise ConfigError(f"{where}.cores={cores!r} must be a whole number >= 1")
        gemm = d.get("gemm_tflops") or {}
        if not isinstance(gemm, dict):
            raise ConfigError(f"{where}.gemm_tflops must be a mapping of dtype to a table")
        gemm = {str(k): _table(v, f"{where}.gemm_tflops.{k}") for k, v in gemm.items()}
        memory = _table(d["memory_gb_s"], f"{where}.memory_gb_s") if d.get("memory_gb_s") else {}
        share = _table(d["cpu_share"], f"{where}.cpu_share") if d.get("cpu_share") else {}
        over = d.get("overhead_us") or {}
        if not isinstance(over, dict) or set(over) - set(OVERHEADS):
            raise ConfigError(f"{where}.overhead_us: fields are {', '.join(OVERHEADS)}")
        over = {k: _num(v, f"{where}.overhead_us.{k}", zero_ok=True) for k, v in over.items()}
        colls = d.get("collectives") or {}
        if not isinstance(colls, dict) or set(colls) - set(OPS):
            raise ConfigError(f"{where}.collectives: operations are {', '.join(OPS)}")
        parsed = {}
        for op, sizes in colls.items():
            if not isinstance(sizes, dict):
                raise ConfigError(f"{where}.collectives.{op} must map group sizes to latency_us and gb_s")
            parsed[op] = {}
            for size, fig in sizes.items():
                w = f"{where}.collectives.{op}.{size}"
                if not isinstance(fig, dict) or set(fig) != {"latency_us", "gb_s"}:
                    raise ConfigError(f"{w} must be {{latency_us: ..., gb_s: ...}}")
                parsed[op][_int_key(size, w)] = (_num(fig["latency_us"], f"{w}.latency_us", zero_ok=True) * 1e-6,
                                                 _num(fig["gb_s"], f"{w}.gb_s") * 1e9)
        errors = d.get("errors") or {}
        if not isinstance(errors, dict) or set(errors) - {"tpot", "ttft", "layouts", "how"}:
            raise ConfigError(f"{where}.errors: fields are tpot, ttft (median |error|), layouts, how")
        errors = {k: _num(errors[k], f"{where}.errors.{k}", zero_ok=True) for k in ("tpot", "ttft") if k in errors}
        steps = d.get("steps") or {}
        if not isinstance(steps, dict) or not all(isinstance(v, dict) and all(isinstance(f, dict) for f in v.values())
                                                  for v in steps.values()):
            raise ConfigError(f"{where}.steps must map a model to layouts, each a fitted step")
        return cls(device=device, cores=cores, how=str(d.get("how", "")), gemm_tflops=gemm, memory_gb_s=memory,
                   overhead_us=over, collectives=parsed, errors=errors, cpu_share=share,
                   steps={str(m): {str(k): dict(f) for k, f in v.items()} for m, v in steps.items()})

    # -- lookups the cost model makes ------------------------------------------------------
    def gemm_flops(self, dtype: str, rows: float) -> float | None:
        """FLOP/s of a GEMM with `rows` rows: the measured table, interpolated in log(rows)
        between measured sizes and held flat beyond them; None if the dtype was not measured."""
        table = self.gemm_tflops.get(dtype)
        if not table:
            return None
        return _interp(table, max(rows, 1.0)) * 1e12

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"

    def memory_bytes_s(self, ranks: int) -> float | None:
        """Read bandwidth of one rank while `ranks` ranks read at once: measured, or beyond the
        largest measured count m, that figure x m / ranks (more ranks share the same cores);
        a GPU's own HBM is not shared, so past m the figure at m holds."""
        if not self.memory_gb_s:
            return None
        return _at(self.memory_gb_s, ranks, shared=not self.gpu) * 1e9

    def share(self, ranks: int) -> float:
        """A rank's compute with `ranks` ranks computing at once, over one rank alone: measured
        (a machine shared with other jobs gives less than a core each), else cores / ranks;
        1 on a GPU node, where each rank has its own GPU."""
        if self.gpu:
            return 1.0
        if self.cpu_share:
            return _at(self.cpu_share, ranks)
        return min(1.0, self.cores / max(ranks, 1))

    def overhead_s(self, name: str) -> float | None:
        v = self.overhead_us.get(name)
        return None if v is None else v * 1e-6

    def collective(self, op: str, size: int) -> tuple[float, float] | None:
        """(latency s, bytes/s) of `op` over `size` ranks: the measured size, else the largest
        measured below it with latency grown by log2 of the ratio (a tree's extra rounds)."""
        sizes = self.collectives.get(op)
        if not sizes or size < 2:
            return None
        if size in sizes:
            return sizes[size]
        below = [s for s in sizes if s < size]
        base = max(below) if below else min(sizes)
        lat, bw = sizes[base]
        return lat * max(1.0, math.log2(size) / math.log2(max(base, 2))), bw

    def to_dict(self) -> dict:
        return {"device": self.device, "cores": self.cores, "how": self.how,
                "gemm_tflops": {k: dict(v) for k, v in self.gemm_tflops.items()},
                "memory_gb_s": dict(self.memory_gb_s), "overhead_us": dict(self.overhead_us),
                "collectives": {op: {s: {"latency_us": lat * 1e6, "gb_s": bw / 1e9} for s, (lat, bw) in v.items()}
                                for op, v in self.collectives.items()},
                "errors": dict(self.errors), "cpu_share": dict(self.cpu_share),
                **({"steps": {m: dict(v) for m, v in self.steps.items()}} if self.steps else {})}


def _at(table: dict[int, float], n: int, *, shared: bool = True) -> float:
    """table[n]; between measured counts the next smaller; past the largest m, table[m] x m / n
    (`shared`: the n ranks share what m had), else table[m]."""
    if n in table:
        return table[n]
    below = [k for k in table if k < n]
    if not below:
        return table[min(table)]
    m = max(below)
    return table[m] * (m / n if shared and m == max(table) else 1.0)


def _interp(table: dict[int, float], x: float) -> float:
    keys = sorted(table)
    if x <= keys[0]:
        return table[keys[0]]
    if x >= keys[-1]:
        return table[keys[-1]]
    for a, b in zip(keys, keys[1:]):
        if a <= x <= b:
            f = (math.log(x) - math.log(a)) / (math.log(b) - math.log(a))
            return table[a] * (table[b] / table[a]) ** f  # geometric between the two
    return table[keys[-1]]
