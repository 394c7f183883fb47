"""The SLO search: which deployment serves a load within its SLOs best (`atoll plan --goodput`).

1. The analytic model scores every layout the planner searches and prunes the hopeless ones
   (candidates.py).
2. The simulator judges the finalists (judge.py): replicas of each colocated finalist behind the
   router, and xPyD splits of the best prefill and decode layouts.
   - Without a request rate each fills the cluster, and the highest goodput per GPU wins.
   - With one, each takes the fewest engines that meet the SLOs at that rate, and the fewest
     GPUs win (then the higher attainment).
3. The engine options are then tuned on the best, one at a time, each change kept when it
   wins: max_num_seqs (a quarter, four times), the chunk budget (twice), the KV dtype (fp8),
   and speculation when an acceptance rate is given.

Beyond Vidur's and AIConfigurator's searches, the simulated engine is atoll's own scheduler,
block pool, router and disaggregation decision, so what is ranked is what `atoll serve` runs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from functools import partial

from atoll.config.engine import default_batched_tokens
from atoll.planner.plot import pareto
from atoll.planner.sim.candidates import finalists, score_layouts, splits
from atoll.planner.sim.deploy import Deployment, on_cpu
from atoll.planner.sim.judge import Judge, Judged, Target
from atoll.planner.sim.pool import run_tasks



@dataclass
class SearchResult:
    target: Target
    best: Judged | None
    judged: list[Judged]  # every deployment simulated, best first
    scored: list  # candidates.Scored, every layout
    reasons: list[str]
    frontier: list[tuple[float, float, str]] = field(default_factory=list)  # (tok/s/user, tok/s/GPU, deployment)
    runs: int = 0
    wall_s: float = 0.0

    def closest(self) -> Judged | None:
        """The deployment nearest to meeting the target (the highest attainment)."""
        judged = [j for j in self.judged if j.closest is not None]
        return max(judged, key=lambda j: j.closest.attainment) if judged else None


def _rank(target: Target):
    if target.rate is None:
        return lambda j: (not j.meets, -j.goodput_per_gpu, j.gpus)
    return lambda j: (not j.meets, j.gpus, -(j.closest.attainment if j.closest else 0.0), _load(j, target))


def _load(j: Judged, target: Target) -> float:
    """The closest run's largest p90 over its SLO (lower: more headroom)."""
    t = j.closest
    if t is None:
        return math.inf
    return max((t.serve[f"{k}_ms"]["p90"] or math.inf) / v for k, v in target.slos.items())


def search(config, topology, make_requests, target: Target, *, base: Deployment, num_prompts: int = 300,
           isl: int, osl: int, burstiness: float = 1.0, seed: int = 0, model_name: str | None = None,
           acceptance: float | None = None, spec_tokens: int = 4, count: int = 4, disagg: bool = True,
           tune: bool = True, progress=None, workers: int | None = None) -> SearchResult:
    """The module's search. make_requests(n): the load's requests; base: the engine options a
    deployment starts from (its layout fields are ignored); count: finalists per family; workers:
    processes judging the finalists (default: every core this process may use, pool.py)."""
    t0 = time.perf_counter()
    scored = score_layouts(config, topology, isl=isl, osl=osl, dtype=base.dtype, kv_dtype=base.kv_dtype,
                           slos_ms=target.slos)
    colocated, prefill, decode = finalists(scored, count, topology.num_gpus, by_size=True)
    judge = Judge(config, topology, make_requests, target, num_prompts=num_prompts, burstiness=burstiness,
                  seed=seed, model_name=model_name, progress=progress)
    n = topology.num_gpus
    judged: list[Judged] = []
    if progress is not None:
        progress(0)
    tasks = [partial(_colocated, base=base, s=s, gpus=n, target=target) for s in colocated]
    if disagg and n >= 2:
        tasks += [partial(_disaggregated, base=base, p=p, dec=dec, gpus=n, target=target)
                  for p in prefill[:1] for dec in decode]
    for out in run_tasks(judge, tasks, workers=workers):
        judged.extend(out if isinstance(out, list) else [out])
    rank = _rank(target)
    judged.sort(key=rank)
    reasons: list[str] = []
    if tune and judged:
        for j in list(judged[:1]):
            better, why = _tune(judge, j, topology, rank, acceptance, spec_tokens)
            if better is not j:
                judged.append(better)
                reasons.extend(why)
        judged = sorted({id(j): j for j in judged}.values(), key=rank)
    best = judged[0] if judged and judged[0].meets else None
    result = SearchResult(target, best, judged, scored, [], runs=judge.runs)
    result.frontier = _frontier(judge)
    result.reasons = _reasons(result, target) + reasons + _counts(scored, judged, judge.runs, time.perf_counter() - t0)
    result.wall_s = time.perf_counter() - t0
    return result


def _colocated(judge: Judge, base: Deployment, s, gpus: int, target: Target) -> Judged:
    d = replace(base, layout=str(s.layout), prefill=None, decode=None)
    most = max(1, gpus // s.world)
    if target.rate is None:
        return judge.judge(replace(d, replicas=most))
    lo, hi = 1, most  # the fewest replicas meeting the rate: bisection (more replicas never hurt)
    top = judge.judge(replace(d, replicas=hi))
    if not top.meets:
        return top
    while lo < hi:
        mid = (lo + hi) // 2
        if judge.judge(replace(d, replicas=mid)).meets:
            hi = mid
        else:
            lo = mid + 1
    return judge.judge(replace(d, replicas=hi))


def _disaggregated(judge: Judge, base: Deployment, p, dec, gpus: int, target: Target) -> list[Judged]:
    d = replace(base, prefill=str(p.layout), decode=str(dec.layout))
    fill = target.rate is None
    out = []
    for x, y in splits(p.world, dec.world, gpus, fill=fill, most=3):
        j = judge.judge(replace(d, prefill_replicas=x, decode_replicas=y))
        out.append(j)
        if not fill and j.meets:  # fewest GPUs first: the first that meets is the one
            break
        if not fill and len(out) >= 8:  # a bound on the runs; the closest is kept
            break
    return out


def _tune(judge: Judge, j: Judged, topology, rank, acceptance, spec_tokens) -> tuple[Judged, list[str]]:
    """One option at a time from j's deployment, each change kept when it ranks better."""
    best, why = j, []
    budget = best.deployment.max_num_batched_tokens or default_batched_tokens(
        None if on_cpu(topology) else topology.gpu.memory_gib)
    seqs = best.deployment.max_num_seqs
    options = [("max_num_seqs", v) for v in (seqs * 4, max(1, seqs // 4)) if v <= 4096]
    options.append(("max_num_batched_tokens", budget * 2))
    if best.deployment.kv_dtype not in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        options.append(("kv_dtype", "fp8"))
    if acceptance is not None and best.deployment.spec_tokens == 0:
        options.append(("spec", spec_tokens))
    if best.deployment.disaggregated and best.deployment.decode_replicas > 1:  # xPyD beside colocated replicas
        options.append(("colocated_replicas", best.deployment.decode_replicas // 2))
    for name, value in options:
        d = best.deployment
        if name == "spec":
            trial = replace(d, spec_tokens=value, acceptance=acceptance)
        else:
            if getattr(d, name) == value:
                continue
            trial = replace(d, **{name: value})
        if not judge.could_beat(trial, best, MARGIN):
            continue
        t = judge.judge(trial)
        if _better(t, best, judge.target):
            why.append(f"{_option(name, value)}: {_gain(best, t, judge.target)}")
            best = t
    return best, why


MARGIN = 0.03  # an option is kept when it wins by more than this share (runs differ by their noise)


def _better(new: Judged, old: Judged, target: Target) -> bool:
    """Whether new beats old by more than noise: meeting where old misses, fewer GPUs, or (with
    neither) MARGIN more goodput per GPU, attainment or headroom."""
    if new.meets != old.meets:
        return new.meets
    if new.gpus != old.gpus and target.rate is not None:
        return new.gpus < old.gpus and new.meets
    if target.rate is None and new.meets:
        return new.goodput_per_gpu > old.goodput_per_gpu * (1 + MARGIN)
    a, b = new.closest.attainment, old.closest.attainment
    if abs(a - b) > MARGIN:
        return a > b
    return _load(new, target) < _load(old, target) * (1 - MARGIN)


def _option(name: str, value) -> str:
    return {"spec": f"speculation ({value} tokens a step)", "kv_dtype": f"KV cache in {value}",
            "colocated_replicas": f"{value} of the decode engines as colocated replicas"}.get(
        name, f"{name} {value}")


def _gain(old: Judged, new: Judged, target: Target) -> str:
    if new.meets and old.meets and new.gpus == old.gpus and new.goodput_per_gpu > old.goodput_per_gpu:
        return f"goodput per GPU {old.goodput_per_gpu:.3g} -> {new.goodput_per_gpu:.3g} req/s"
    if new.meets and not old.meets:
        return "meets the SLOs where the default does not"
    if new.gpus < old.gpus:
        return f"{old.gpus} -> {new.gpus} GPUs"
    if new.closest.attainment != old.closest.attainment:
        return f"attainment {old.closest.attainment:.3f} -> {new.closest.attainment:.3f}"
    return f"the largest p90 over its SLO {_load(old, target):.2f} -> {_load(new, target):.2f}"


def _frontier(judge: Judge) -> list[tuple[float, float, str]]:
    """Every run meeting the SLOs, as (tokens/s/user, tokens/s/GPU, deployment), on the Pareto front."""
    pts = []
    for j in judge.cache.values():
        for t in j.trials:
            if t.attainment >= judge.target.attainment and not math.isinf(t.rate):
                x, y = t.point(j.gpus)
                pts.append((x, y, f"{j.deployment.describe()} @{t.rate:.3g}/s"))
    front = pareto([(x, y) for x, y, _ in pts])
    return [pts[i] for i in front]


def _family(j: Judged) -> str:
    return "xPyD" if j.deployment.disaggregated else "colocated"


def _metric(t, name: str) -> str:
    v = t.serve[f"{name}_ms"]["p90"]
    return f"p90 {name.upper()} {v:.0f} ms" if v is not None else f"no {name.upper()}"


def _reasons(r: SearchResult, target: Target) -> list[str]:
    out = []
    if r.best is None:
        c = r.closest()
        if c is None:
            return ["no deployment could be simulated: no layout fits or every one misses an SLO alone"]
        t = c.closest
        where = f"at {t.rate:.3g} req/s" if not math.isinf(t.rate) else "saturated"
        return [f"no deployment meets {target.describe()}" + (f" at {target.rate:g} req/s" if target.rate else "")
                + f"; closest is {c.deployment.describe()} on {c.gpus} GPUs: attainment {t.attainment:.3f} {where} "
                f"({t.binding()} binds: {_metric(t, t.binding())} against {target.slos[t.binding()]:g} ms)"]
    b = r.best
    if target.rate is None:
        out.append(f"{b.deployment.describe()}: the highest goodput per GPU, {b.goodput_per_gpu:.3g} req/s "
                   f"({b.rate:.3g} req/s on {b.gpus} GPUs) with {target.describe()}")
    else:
        out.append(f"{b.deployment.describe()}: the fewest GPUs ({b.gpus}) meeting {target.describe()} at "
                   f"{target.rate:g} req/s (attainment {b.best.attainment:.3f})")
    t = b.best
    out.append(f"at that rate {_metric(t, 'ttft')}, {_metric(t, 'tpot')}; its steps: "
               + "; ".join(f"{e['engine']} busy {e['busy_share']:.0%}, bound by {e['bound_by'][0]['what']}"
                           for e in t.engines[:2] if e["bound_by"] and e["busy_share"] is not None))
    if b.limit is not None:
        out.append(f"above it {b.limit.binding()} binds first (attainment {b.limit.attainment:.3f} at "
                   f"{b.limit.rate:.3g} req/s)")
    other = next((j for j in r.judged if _family(j) != _family(b)), None)
    if other is not None:
        if other.meets:
            vs = (f"{other.goodput_per_gpu:.3g} req/s per GPU" if target.rate is None else f"{other.gpus} GPUs")
        else:
            c = other.closest
            vs = f"misses ({c.binding()} binds, attainment {c.attainment:.3f})" if c else "misses"
        out.append(f"the best {_family(other)} deployment, {other.deployment.describe()}: {vs}")
    return out


def _counts(scored, judged, runs: int, wall: float) -> list[str]:
    dropped = [s for s in scored if s.why]
    text = f"searched {len(scored)} layouts analytically"
    if dropped:
        text += f" ({len(dropped)} pruned, e.g. {dropped[0].layout}: {dropped[0].why})"
    return [text + f"; simulated {len(judged)} deployments in {runs} runs, {wall:.1f} s"]
