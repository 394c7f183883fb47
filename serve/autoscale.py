"""--autoscale against --goodput ttft:MS tpot:MS: decisions from the live load, with a hysteresis.

Every look at the server is a Sample: the share of first tokens and of inter-token gaps within
the SLOs since the last look (their attainment), the requests waiting for their first token
(the prefill queue), the KV blocks in use, and, where the planner's step costs are given
(serve.predict), the estimates made from them: the prefill queue's wait and the TPOT of the
running batch, each the planner's predicted seconds times the engines' live correction factor
(the median of measured / predicted step seconds), so that a queue that will miss its TTFT
is seen before its first tokens come late. `decide` reads the samples of the last window and says
what to change, with its reason:

- short on first tokens (TTFT attainment under target - margin, or the estimated queue wait
  over (1 + margin) x the TTFT SLO): on a disaggregated fleet, raise the local-prefill
  threshold first (the decode engines prefill more prompts themselves) while decode has room;
  else add a prefill engine; else turn a decode engine with room into a prefill one;
- short on tokens (TPOT attainment under target - margin, the estimated TPOT over (1 + margin)
  x its SLO, or KV use over kv_high): lower a raised threshold first; else add a decode
  engine; else turn a prefill engine with room into a decode one;
- a replicas fleet adds a replica when short either way, and drains one when everything is over
  target + margin, KV use is under kv_low, nothing waits and the TPOT estimated with one engine
  fewer stays under (1 - margin) x its SLO (a drain the next look would undo is not made).

Hysteresis: nothing within interval_s of the last decision, nothing undoing the last decision
(a drain after an add, an add after a drain, a threshold lowered after it was raised) within
settle x interval_s of it (a drain a short load would undo at once flapped every interval on a
2-core machine: TPOT attainment's tail, from prompt chunks beside the rows, was not in the
estimate), nothing from fewer than min_samples
samples, the estimates averaged over the window, and the margin on both sides of the target
(attainment) and of each SLO (estimates: room only under (1 - margin) x the SLO), so a load
near them changes nothing.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from atoll.errors import InputError


@dataclass(frozen=True)
class Goodput:
    ttft_s: float
    tpot_s: float

    @classmethod
    def parse(cls, items: list[str]) -> Goodput:
        """["ttft:500", "tpot:50"] (milliseconds) as --goodput gives them."""
        got: dict[str, float] = {}
        for item in items:
            name, _, ms = str(item).partition(":")
            if name not in ("ttft", "tpot"):
                raise InputError(f"--goodput {item!r}: give ttft:MS and tpot:MS")
            try:
                value = float(ms)
            except ValueError:
                value = -1.0
            if not value > 0:
                raise InputError(f"--goodput {item!r}: {name} must be a positive number of milliseconds")
            got[name] = value / 1000
        missing = [n for n in ("ttft", "tpot") if n not in got]
        if missing:
            raise InputError(f"--goodput: {missing[0]}:MS is missing (give ttft:MS tpot:MS)")
        return cls(got["ttft"], got["tpot"])


@dataclass(frozen=True)
class Sample:
    at: float  # seconds (monotonic)
    ttft_ok: float | None  # first tokens within the TTFT SLO since the last sample, a share (None: none came)
    tpot_ok: float | None  # inter-token gaps within the TPOT SLO, a share
    waiting: float  # requests waiting for their first token
    kv_used: float  # KV blocks in use / blocks, 0..1
    queue_s: float | None = None  # the prefill queue's estimated wait (serve.predict), where estimated
    tpot_s: float | None = None  # the running batch's estimated TPOT
    queue_more_s: float | None = None  # the queue's estimated wait with one prefill engine (replica) more
    tpot_less_s: float | None = None  # the estimated TPOT with one decode engine (replica) fewer
    correction: float | None = None  # the live correction factor the queue's wait was made with
    tpot_correction: float | None = None  # and the one TPOT's was


@dataclass(frozen=True)
class Fleet:
    """What serves now: replicas, or prefill and decode engines; free slots (drained or removed
    engines); the local-prefill threshold (prompt tokens) where the fleet is disaggregated."""
    replicas: int = 0
    prefill: int = 0
    decode: int = 0
    free: int = 0
    threshold: int | None = None
    base_threshold: int | None = None
    # (monotonic seconds, uncached prompt tokens) of recent prompts sent to the prefill engines;
    # None where not known (a threshold raise then doubles, blind)
    remote_prompts: tuple[tuple[float, int], ...] | None = None


@dataclass(frozen=True)
class Decision:
    action: str  # threshold, add, drain, role
    role: str  # replica, prefill, decode: the engine added or drained, the role an engine takes
    reason: str
    threshold: int | None = None  # the new local-prefill threshold (action threshold)


@dataclass(frozen=True)
class Policy:
    target: float = 0.9  # the attainment aimed for
    margin: float = 0.05  # hysteresis: act under target - margin, scale in over target + margin
    interval_s: float = 30.0  # at least this long between two decisions
    window_s: float = 30.0  # the samples a decision reads
    settle: float = 4.0  # a decision undoing the last one (a drain after an add, ...) waits settle x interval_s
    min_samples: int = 3
    kv_high: float = 0.9
    kv_low: float = 0.5
    max_threshold: int = 4096

    def __post_init__(self):
        if not 0 < self.target <= 1 or not 0 <= self.margin < self.target:
            raise InputError(f"autoscale target={self.target} margin={self.margin}: need 0 <= margin < target <= 1")
        if not self.interval_s >= 0 or not self.window_s > 0 or self.min_samples < 1 or not self.settle >= 1:
            raise InputError("autoscale interval_s >= 0, window_s > 0, min_samples >= 1 and settle >= 1 are needed")


class Correction:
    """A live correction factor for a cost model's predictions: the median of observed / predicted
    seconds over the last `window` observations (1.0 until something is observed), so a few steps
    slowed by something else on the machine do not move it."""

    def __init__(self, window: int = 64):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise InputError(f"correction window={window!r} must be a whole number of at least 1")
        self.ratios: deque[float] = deque(maxlen=window)

    def observe(self, predicted_s: float, observed_s: float) -> None:
        if predicted_s > 0 and observed_s > 0:
            self.ratios.append(observed_s / predicted_s)

    @property
    def factor(self) -> float:
        return statistics.median(self.ratios) if self.ratios else 1.0

    def estimate(self, predicted_s: float) -> float:
        return predicted_s * self.factor


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def direction(d: Decision, fleet: Fleet) -> str:
    """Which way a decision moves the fleet, for telling when one undoes the last: "+replica"
    (added) and "-replica" (drained), "+threshold" and "-threshold", "+prefill" and "-prefill"
    (an engine turned into a prefill or a decode one)."""
    if d.action == "threshold":
        return "+threshold" if fleet.threshold is None or d.threshold > fleet.threshold else "-threshold"
    if d.action in ("add", "drain"):
        return ("+" if d.action == "add" else "-") + d.role
    return "+prefill" if d.role == "prefill" else "-prefill"


def _opposite(a: str, b: str) -> bool:
    return a[1:] == b[1:] and a[0] != b[0]


def decide(history: list[Sample], fleet: Fleet, goodput: Goodput, policy: Policy, *, now: float,
           last_at: float | None, last: str | None = None) -> Decision | None:
    """What to change now, from the samples of the last window; None: nothing (or too soon).
    last: the direction() of the last decision: one undoing it waits settle x interval_s."""
    if last_at is not None and now - last_at < policy.interval_s:
        return None
    d = _decide(history, fleet, goodput, policy, now=now)
    if d is not None and last is not None and last_at is not None and _opposite(direction(d, fleet), last) \
            and now - last_at < policy.settle * policy.interval_s:
        return None
    return d


def _decide(history: list[Sample], fleet: Fleet, goodput: Goodput, policy: Policy, *, now: float) -> Decision | None:
    window = [s for s in history if now - policy.window_s <= s.at <= now]
    if len(window) < policy.min_samples:
        return None
    ttft, tpot = _mean([s.ttft_ok for s in window]), _mean([s.tpot_ok for s in window])
    kv, waiting = _mean([s.kv_used for s in window]), _mean([s.waiting for s in window])
    est = {name: _mean([getattr(s, name) for s in window])
           for name in ("queue_s", "tpot_s", "queue_more_s", "tpot_less_s", "correction", "tpot_correction")}
    queue_s, tpot_s = est["queue_s"], est["tpot_s"]
    low, high = policy.target - policy.margin, policy.target + policy.margin
    factor, tpot_factor = (f" (predicted x correction {est[k]:.2f})" if est[k] is not None else ""
                           for k in ("correction", "tpot_correction"))
    why_first = []
    if ttft is not None and ttft < low:
        why_first.append(f"TTFT attainment {ttft:.0%} < {low:.0%}")
    over, under = 1 + policy.margin, 1 - policy.margin  # the estimates' hysteresis, around each SLO
    late = queue_s is not None and queue_s > goodput.ttft_s * over
    if late:
        why_first.append(f"the prefill queue's estimated wait {queue_s * 1000:.0f} ms{factor} > TTFT SLO "
                         f"{goodput.ttft_s * 1000:.0f} ms")
    why_tokens = []
    if tpot is not None and tpot < low:
        why_tokens.append(f"TPOT attainment {tpot:.0%} < {low:.0%}")
    if tpot_s is not None and tpot_s > goodput.tpot_s * over:
        why_tokens.append(f"estimated TPOT {tpot_s * 1000:.1f} ms{tpot_factor} > TPOT SLO {goodput.tpot_s * 1000:.1f} ms")
    if kv > policy.kv_high:
        why_tokens.append(f"KV use {kv:.0%} > {policy.kv_high:.0%}")
    tokens_room = (tpot is None or tpot >= high) and kv < policy.kv_high and not why_tokens
    tokens_room = tokens_room and (tpot_s is None or tpot_s < goodput.tpot_s * under)
    first_room = (ttft is None or ttft >= high) and (queue_s is None or queue_s < goodput.ttft_s * under)
    helps = f" (estimated wait with it {est['queue_more_s'] * 1000:.0f} ms)" \
        if late and est["queue_more_s"] is not None else ""
    if fleet.prefill + fleet.decode == 0:
        fewer = est["tpot_less_s"]
        safe = fewer is None or fewer < goodput.tpot_s * under
        return _replicas(fleet, why_first + why_tokens, tokens_room and first_room and kv < policy.kv_low
                         and waiting < 0.5 and safe, ttft, tpot, kv, helps)
    if why_first and not why_tokens:
        reason = "; ".join(why_first)
        new = _raised(fleet, policy, now) if tokens_room else None
        if new is not None:
            return Decision("threshold", "decode", f"{reason}: decode has room, more prompts prefilled there "
                                                   f"(local-prefill threshold {fleet.threshold} -> {new})", new)
        if fleet.free:
            return Decision("add", "prefill", f"{reason}: a prefill engine added{helps}")
        if fleet.decode > 1 and tokens_room:
            return Decision("role", "prefill", f"{reason}: a decode engine with room turns prefill")
        return None
    if why_tokens:
        reason = "; ".join(why_tokens + why_first)
        base = fleet.base_threshold if fleet.base_threshold is not None else fleet.threshold
        if fleet.threshold is not None and base is not None and fleet.threshold > base and not why_first:
            new = max(base, fleet.threshold // 2)
            return Decision("threshold", "decode", f"{reason}: fewer prompts prefilled on decode "
                                                   f"(local-prefill threshold {fleet.threshold} -> {new})", new)
        if fleet.free:
            return Decision("add", "decode", f"{reason}: a decode engine added")
        if fleet.prefill > 1 and first_room:
            return Decision("role", "decode", f"{reason}: a prefill engine with room turns decode")
    return None


def _raised(fleet: Fleet, policy: Policy, now: float) -> int | None:
    """The local-prefill threshold to raise to: at least double, and high enough to keep the
    shortest prompt the prefill engines took over the window on its decode engine (a prompt stays
    local when shorter than the threshold); None when at the cap, or when no prompt sent there over
    the window is under the cap (a raise would move none)."""
    if fleet.threshold is None or fleet.threshold >= policy.max_threshold:
        return None
    doubled = min(policy.max_threshold, max(1, fleet.threshold) * 2)
    if fleet.remote_prompts is None:
        return doubled
    movable = [n for at, n in fleet.remote_prompts if at >= now - policy.window_s and n < policy.max_threshold]
    if not movable:
        return None
    return min(policy.max_threshold, max(doubled, min(movable) + 1))


def _replicas(fleet: Fleet, short: list[str], idle: bool, ttft, tpot, kv, helps: str = "") -> Decision | None:
    if short and fleet.free:
        return Decision("add", "replica", "; ".join(short) + f": a replica added{helps}")
    if idle and fleet.replicas > 1:
        seen = ", ".join(f"{name} attainment {v:.0%}" for name, v in (("TTFT", ttft), ("TPOT", tpot)) if v is not None)
        return Decision("drain", "replica", f"{seen or 'no requests'}, KV use {kv:.0%}, nothing waiting: "
                                            "a replica drained")
    return None
