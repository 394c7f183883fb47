"""`atoll bench serve --chaos SPEC`: the faults to strike, and the figures of a run by phase.

SPEC is faults separated by commas, each `KIND@SECONDS` with `:key=value` options:

    kill@5:engine=1            SIGKILL engine 1's rank (default engine 0, rank 0 of it) 5 s into the load
    stop@10:engine=0:for=3     SIGSTOP it, SIGCONT 3 s later (default for=5)
    slow@15:ms=50:for=4        for 4 s, stop it 50 ms of every 100 ms (a rank at about half speed)
    random:n=3:seed=7:within=30:kinds=kill+stop   n faults of those kinds at seeded random times in
                               [1, within) s on seeded random engines (engines counted when the run starts)
    random:n=10:seed=7:every=60   n faults, one every 60 s (at 60, 120, ...), each on a seeded random engine

Times count from the first request of the faulted run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from atoll.errors import ConfigError

KINDS = ("kill", "stop", "slow")
PERIOD_S = 0.1  # slow: the duty cycle's period


@dataclass(frozen=True)
class Fault:
    kind: str
    at_s: float
    engine: int = 0
    rank: int = 0
    for_s: float = 5.0  # stop, slow: how long
    ms: float = 50.0  # slow: stopped this many ms of every 100

    def label(self) -> str:
        more = "" if self.kind == "kill" else f" for {self.for_s:g} s" + (f", {self.ms:g} ms/100 ms" if self.kind == "slow" else "")
        return f"{self.kind} engine {self.engine} rank {self.rank} at {self.at_s:g} s{more}"


def _number(item: str, key: str, text: str, *, whole: bool = False) -> float:
    try:
        value = int(text) if whole else float(text)
    except ValueError:
        value = -1
    if not value >= 0:
        raise ConfigError(f"--chaos {item!r}: {key}={text!r} must be a {'whole ' if whole else ''}number >= 0")
    return value


def _options(item: str, parts: list[str], allowed: tuple) -> dict:
    out = {}
    for part in parts:
        key, eq, value = part.partition("=")
        if not eq or key not in allowed:
            raise ConfigError(f"--chaos {item!r}: {part!r} is not one of {', '.join(k + '=' for k in allowed)}")
        out[key] = value
    return out


def parse_chaos(spec: str, engines: int) -> list[Fault]:
    """SPEC's faults in time order, each checked (one line naming the bad part); random faults
    drawn for `engines` engines."""
    faults: list[Fault] = []
    for item in [s.strip() for s in str(spec).split(",") if s.strip()]:
        head, *parts = item.split(":")
        if head == "random":
            faults += _random(item, _options(item, parts, ("n", "seed", "within", "every", "kinds")), engines)
            continue
        kind, at, when = head.partition("@")
        if kind not in KINDS or not at:
            raise ConfigError(f"--chaos {item!r}: give KIND@SECONDS with KIND one of {', '.join(KINDS)}, or random:...")
        o = _options(item, parts, ("engine", "rank", "for", "ms"))
        fault = Fault(kind, _number(item, "time", when), engine=int(_number(item, "engine", o.get("engine", "0"), whole=True)),
                      rank=int(_number(item, "rank", o.get("rank", "0"), whole=True)),
                      for_s=_number(item, "for", o.get("for", "5")), ms=_number(item, "ms", o.get("ms", "50")))
        if fault.engine >= engines:
            raise ConfigError(f"--chaos {item!r}: engine={fault.engine} but the server has engines 0..{engines - 1}")
        if not 0 < fault.ms < PERIOD_S * 1000:
            raise ConfigError(f"--chaos {item!r}: ms={fault.ms:g} must lie between 0 and {PERIOD_S * 1000:g}")
        faults.append(fault)
    if not faults:
        raise ConfigError(f"--chaos {spec!r}: no fault given (e.g. kill@5:engine=1)")
    return sorted(faults, key=lambda f: f.at_s)


def _random(item: str, o: dict, engines: int) -> list[Fault]:
    n = int(_number(item, "n", o.get("n", "1"), whole=True))
    within = _number(item, "within", o.get("within", "30"))
    kinds = o.get("kinds", "kill").split("+")
    if any(k not in KINDS for k in kinds) or n < 1 or within <= 1:
        raise ConfigError(f"--chaos {item!r}: n >= 1, within > 1 and kinds from {'+'.join(KINDS)} are needed")
    rng = random.Random(int(_number(item, "seed", o.get("seed", "0"), whole=True)))
    if "every" in o:
        every = _number(item, "every", o["every"])
        if every <= 0 or "within" in o:
            raise ConfigError(f"--chaos {item!r}: every= takes seconds above 0, and not with within=")
        return [Fault(rng.choice(kinds), round(every * (i + 1), 2), engine=rng.randrange(engines)) for i in range(n)]
    return [Fault(rng.choice(kinds), round(rng.uniform(1, within), 2), engine=rng.randrange(engines))
            for _ in range(n)]


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (linear between the nearest ranks, numpy's default); None for none."""
    if not values:
        return None
    v = sorted(values)
    x = (len(v) - 1) * q / 100
    lo = int(x)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (x - lo)


def phases(results: list, faults: list[Fault], recovered: list[float | None], end_s: float) -> list[dict]:
    """Per fault, the requests sent before it (since the last recovery), during it (until its
    capacity was back) and after (until the next fault): their count and TTFT / TPOT p50 and
    p99 in ms. results: RequestResult with .start, .ttft, .tpot, .success."""
    out = []
    for i, (f, back) in enumerate(zip(faults, recovered)):
        since = (recovered[i - 1] or faults[i - 1].at_s) if i else 0.0
        until = faults[i + 1].at_s if i + 1 < len(faults) else end_s
        back = back if back is not None else until
        row = {"fault": f.label(), "recovered_s": None if recovered[i] is None else round(recovered[i] - f.at_s, 2)}
        for name, lo, hi in (("before", since, f.at_s), ("during", f.at_s, back), ("after", back, until)):
            done = [r for r in results if lo <= r.start < hi and r.success]
            row[name] = {"requests": len(done),
                         **{f"{m}_p{q}_ms": _ms(percentile([getattr(r, m) for r in done], q))
                            for m in ("ttft", "tpot") for q in (50, 99)}}
        out.append(row)
    return out


def outside_recovery(results: list, clean: list, faults: list[Fault], recovered: list[float | None],
                     end_s: float) -> dict:
    """The requests whose whole life (send to last token) lies outside every fault's recovery
    window (from the fault until its engine served again; to the next fault, or the end, when it
    never did): their count and TTFT / TPOT p99 in ms, beside the no-fault run's p99 over all its
    requests, and their ratios."""
    windows = []
    for i, (f, back) in enumerate(zip(faults, recovered)):
        until = faults[i + 1].at_s if i + 1 < len(faults) else end_s
        windows.append((f.at_s, back if back is not None else until))
    done = [r for r in results if r.success and not any(r.start < hi and lo < r.start + r.latency
                                                        for lo, hi in windows)]
    base = [r for r in clean if r.success]
    out = {"requests": len(done)}
    for m in ("ttft", "tpot"):
        got, ref = (_ms(percentile([getattr(r, m) for r in rs], 99)) for rs in (done, base))
        out[f"{m}_p99_ms"], out[f"no_fault_{m}_p99_ms"] = got, ref
        out[f"{m}_p99_over_no_fault"] = round(got / ref, 3) if got is not None and ref else None
    return out


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1000, 1)
