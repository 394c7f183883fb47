"""--autoscale against --goodput ttft:MS tpot:MS: decisions from the live load, with a hysteresis.

Every look at the server is a Sample: the share of first tokens and of inter-token gaps within
the SLOs since the last look (their attainment), the requests waiting for their first token
(the prefill queue), the KV blocks in use, and, where a cost function is given, the queue's
estimated wait (its predicted seconds times a live correction factor: observed / predicted).
`decide` reads the samples of the last window and says what to change, with its reason:

- short on first tokens (TTFT attainment under target - margin, or the estimated queue wait over
  the TTFT SLO): on a disaggregated fleet, raise the local-prefill threshold first (the decode
  engines prefill more prompts themselves) while decode has room; else add a prefill engine;
  else turn a decode engine with room into a prefill one;
- short on tokens (TPOT attainment under target - margin, or KV use over kv_high): lower a raised
  threshold first; else add a decode engine; else turn a prefill engine with room into a decode one;
- a replicas fleet adds a replica when short either way, and drains one when everything is over
  target + margin, KV use is under kv_low and nothing waits.

Hysteresis: nothing within interval_s of the last decision, nothing from fewer than min_samples
samples, and the margin on both sides of the target, so a load near the target changes nothing.
"""

from __future__ import annotations

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
    queue_s: float | None = None  # the queue's estimated wait (Correction.estimate), where estimated


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
    min_samples: int = 3
    kv_high: float = 0.9
    kv_low: float = 0.5
    max_threshold: int = 4096

    def __post_init__(self):
        if not 0 < self.target <= 1 or not 0 <= self.margin < self.target:
            raise InputError(f"autoscale target={self.target} margin={self.margin}: need 0 <= margin < target <= 1")
        if not self.interval_s >= 0 or not self.window_s > 0 or self.min_samples < 1:
            raise InputError("autoscale interval_s >= 0, window_s > 0 and min_samples >= 1 are needed")


class Correction:
    """A live correction factor for a cost model's predictions: an exponential mean of
    observed / predicted seconds (1.0 until something is observed)."""

    def __init__(self, alpha: float = 0.3):
        self.alpha, self.factor = alpha, 1.0

    def observe(self, predicted_s: float, observed_s: float) -> None:
        if predicted_s > 0 and observed_s >= 0:
            self.factor += self.alpha * (observed_s / predicted_s - self.factor)

    def estimate(self, predicted_s: float) -> float:
        return predicted_s * self.factor


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def decide(history: list[Sample], fleet: Fleet, goodput: Goodput, policy: Policy, *, now: float,
           last_at: float | None) -> Decision | None:
    """What to change now, from the samples of the last window; None: nothing (or too soon)."""
    if last_at is not None and now - last_at < policy.interval_s:
        return None
    window = [s for s in history if now - policy.window_s <= s.at <= now]
    if len(window) < policy.min_samples:
        return None
    ttft, tpot = _mean([s.ttft_ok for s in window]), _mean([s.tpot_ok for s in window])
    kv, waiting, queue_s = _mean([s.kv_used for s in window]), _mean([s.waiting for s in window]), \
        _mean([s.queue_s for s in window])
    low, high = policy.target - policy.margin, policy.target + policy.margin
    why_first = []
    if ttft is not None and ttft < low:
        why_first.append(f"TTFT attainment {ttft:.0%} < {low:.0%}")
    if queue_s is not None and queue_s > goodput.ttft_s:
        why_first.append(f"the prefill queue's estimated wait {queue_s * 1000:.0f} ms > TTFT SLO "
                         f"{goodput.ttft_s * 1000:.0f} ms")
    why_tokens = []
    if tpot is not None and tpot < low:
        why_tokens.append(f"TPOT attainment {tpot:.0%} < {low:.0%}")
    if kv > policy.kv_high:
        why_tokens.append(f"KV use {kv:.0%} > {policy.kv_high:.0%}")
    tokens_room = (tpot is None or tpot >= high) and kv < policy.kv_high
    first_room = (ttft is None or ttft >= high) and not (queue_s is not None and queue_s > goodput.ttft_s)
    if fleet.prefill + fleet.decode == 0:
        return _replicas(fleet, why_first + why_tokens, tokens_room and first_room and kv < policy.kv_low
                         and waiting < 0.5, ttft, tpot, kv)
    if why_first and not why_tokens:
        reason = "; ".join(why_first)
        if fleet.threshold is not None and fleet.threshold < policy.max_threshold and tokens_room:
            new = min(policy.max_threshold, max(1, fleet.threshold) * 2)
            return Decision("threshold", "decode", f"{reason}: decode has room, more prompts prefilled there "
                                                   f"(local-prefill threshold {fleet.threshold} -> {new})", new)
        if fleet.free:
            return Decision("add", "prefill", f"{reason}: a prefill engine added")
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


def _replicas(fleet: Fleet, short: list[str], idle: bool, ttft, tpot, kv) -> Decision | None:
    if short and fleet.free:
        return Decision("add", "replica", "; ".join(short) + ": a replica added")
    if idle and fleet.replicas > 1:
        seen = ", ".join(f"{name} attainment {v:.0%}" for name, v in (("TTFT", ttft), ("TPOT", tpot)) if v is not None)
        return Decision("drain", "replica", f"{seen or 'no requests'}, KV use {kv:.0%}, nothing waiting: "
                                            "a replica drained")
    return None
