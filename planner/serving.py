"""Steady serving: TPOT with prompt chunks running beside decode, TTFT with queueing.

A replica serves requests of `isl` prompt and `osl` output tokens with chunked prefill: every
step decodes the sequences in flight and carries up to `budget` prompt tokens, in chunks of at
most `budget` tokens (a prompt longer than that takes several steps). `step(n, k, length)` (the
cost model) is the time of one step decoding n sequences and carrying k chunks of `length`
tokens; n may be fractional (interpolated between whole batches).

Arrival rate λ per replica. Open loop: Poisson at the given rate. Closed loop: C clients, each
sending its next request when its last one ends; by Little's law over a request's life
λ = C / (TTFT + osl * TPOT), solved by Steffensen's fixed-point iteration kept inside the
bracket its evaluations give (the right side falls as λ grows).

TPOT: the mean step a decoding request sees. The other requests' prompts arrive during it at
rate λ_o (λ in open loop, Poisson arrivals seeing time averages; λ(C-1)/C in closed loop, its own
client waiting for it), ceil(isl/budget) chunks each, so a step carries K ~ Poisson(λ_o TPOT
chunks) chunks, at most what the budget holds; n = 1 + λ_o osl TPOT sequences decode (Little).
TPOT = E[step(n, K, chunk)], itself a fixed point (the step time sets how many chunks arrive),
found by Steffensen's iteration too.

TTFT = half a step (the running step ends; none when nothing else is decoding)
     + the wait behind earlier prompts, M/D/1 (Poisson arrivals, deterministic service, one
       server, FCFS): W = ρS / (2(1 - ρ)), where S = isl over the rate at which full-budget
       steps prefill, and ρ = λ_o S (the prompts ahead of it are the others')
     + its own chunks, one step each (a step of the other n - 1 sequences and the chunk).

ρ >= 1 in open loop: prompts arrive faster than the steps can prefill them, the queue grows
without bound; likewise when more requests would be decoding than the concurrency the KV cache
was planned for. Such a load is not sustainable. A closed loop always is: a slower server
slows its own arrivals. Assumed: every request isl in and osl out; steps are not preempted;
closed-loop arrivals are costed as Poisson at their mean rate.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass

_POISSON_TERMS = 50  # beyond this mean the chunk count is concentrated: its mean stands for it
# whole decode batches the cost model is asked for: every one up to _EXACT, then _SPACING apart
# (a step's time is near linear in the batch between them; this bounds the calls per layout)
_EXACT, _SPACING = 64, 0.03


@dataclass(frozen=True)
class Steady:
    tpot_s: float  # mean decode step a request sees
    ttft_s: float  # mean time to first token (inf: not sustainable)
    rate: float  # requests per second on the replica
    decode_batch: float  # sequences decoding in a step
    chunks_per_step: float  # mean prompt chunks in a step
    chunk_tokens: float  # tokens of one chunk
    chunk_cap: int  # chunks one step can carry (the budget)
    load: float  # ρ: prefill work offered over what full-budget steps can do
    sustainable: bool = True
    why: str = ""  # when not sustainable, in words

    def e2e_s(self, osl: int) -> float:
        return self.ttft_s + osl * self.tpot_s


def md1_wait(rate: float, service: float) -> float:
    """Mean wait in queue of M/D/1: ρS / (2(1 - ρ)), ρ = rate * service; inf when ρ >= 1."""
    rho = rate * service
    return math.inf if rho >= 1 else rho * service / (2 * (1 - rho))


def poisson_weights(mean: float, cap: int) -> list[tuple[float, float]]:
    """(k, probability) of min(K, cap) for K ~ Poisson(mean); a concentrated K (mean over
    _POISSON_TERMS) as its mean alone."""
    if mean <= 0:
        return [(0, 1.0)]
    if mean > _POISSON_TERMS:
        return [(min(mean, cap), 1.0)]
    out, mass, pmf = [], 0.0, math.exp(-mean)
    for k in range(cap):
        out.append((k, pmf))
        mass += pmf
        if 1 - mass < 1e-7:
            return out + [(k + 1, 1 - mass)]
        pmf *= mean / (k + 1)
    return out + [(cap, 1 - mass)]


def poisson_mean(f, mean: float, cap: int) -> float:
    """E[f(min(K, cap))] for K ~ Poisson(mean)."""
    return sum(w * f(k) for k, w in poisson_weights(mean, cap))


_GRID = sorted({round(_EXACT * (1 + _SPACING) ** i) for i in range(500)})


def _bracket(n: float) -> tuple[int, int]:
    """Neighbouring whole batches lo <= n < hi: every one below _EXACT, then the grid."""
    if n < _EXACT or n >= _GRID[-1]:
        return math.floor(n), math.floor(n) + 1
    i = bisect.bisect_right(_GRID, n)
    return _GRID[i - 1], _GRID[i]


def _aitken(x: float, f1: float, f2: float) -> float:
    """Steffensen's next estimate of the fixed point x = f(x) from f1 = f(x), f2 = f(f1)
    (Aitken's delta-squared); f2 where the differences vanish."""
    den = f2 - 2 * f1 + x
    return x - (f1 - x) ** 2 / den if den else f2


class _Replica:
    def __init__(self, step, *, isl: int, osl: int, concurrency: int, budget: int, open_loop: bool):
        self.isl, self.osl, self.b, self.open = isl, osl, concurrency, open_loop
        self.chunks = math.ceil(isl / budget)  # chunks of one prompt, one step each
        self.chunk = isl / self.chunks
        self.cap = max(1, int(budget // math.ceil(self.chunk)))  # chunks one step can carry
        self._step, self._memo = step, {}

    def step(self, n: float, k: float) -> float:
        lo, hi = _bracket(n)
        a = self._whole(lo, k)
        return a if n == lo else a + (n - lo) / (hi - lo) * (self._whole(hi, k) - a)

    def _whole(self, n: int, k: float) -> float:
        if (n, k) not in self._memo:
            self._memo[(n, k)] = self._step(n, k, self.chunk)
        return self._memo[(n, k)]

    def at(self, rate: float) -> Steady:
        """The replica's steady state at `rate` requests/s."""
        others_rate = rate if self.open else rate * (self.b - 1) / self.b

        def others_at(t):  # requests decoding beside this one (Little)
            return min(self.b - 1, others_rate * self.osl * t)

        def mean_step(t):  # the mean step when a step takes t: its chunks arrive during it
            return poisson_mean(lambda k: self.step(1 + others_at(t), k), others_rate * t * self.chunks, self.cap)

        tpot = self.step(1, 0)
        for _ in range(50):  # Steffensen's iteration (Aitken's delta-squared) on tpot = mean_step(tpot)
            f1 = mean_step(tpot)
            if abs(f1 - tpot) <= 1e-10 * tpot:
                tpot = f1
                break
            f2 = mean_step(f1)
            nxt = _aitken(tpot, f1, f2)
            tpot = nxt if 0 < nxt < math.inf else f2
        others = others_at(tpot)
        full = self.step(1 + others, self.cap)  # a step carrying all the prompt tokens it can
        service = self.isl * full / (self.cap * self.chunk)
        load = rate * service
        # the prompts ahead of this one come from the other clients (all arrivals in open loop)
        ttft = (tpot / 2 if others > 0 else 0.0) + md1_wait(others_rate, service) + self.chunks * self.step(others, 1)
        why = ""
        if self.open and load >= 1:
            why = (f"prompts arrive faster than the steps prefill them (prefill load {load:.2f} >= 1 "
                   f"at {rate:.3g} requests/s per replica)")
        elif self.open and rate * self.osl * tpot > self.b:
            why = (f"{rate * self.osl * tpot:.0f} requests would be decoding at once per replica, more than "
                   f"the {self.b} the KV cache is planned for")
        return Steady(tpot_s=tpot, ttft_s=math.inf if why else ttft, rate=rate, decode_batch=1 + others,
                      chunks_per_step=others_rate * tpot * self.chunks, chunk_tokens=self.chunk,
                      chunk_cap=self.cap, load=load,
                      sustainable=not why, why=why)

    def closed(self) -> Steady:
        """The closed loop's fixed point: rate * (TTFT + osl * TPOT) = concurrency, by
        Steffensen's iteration on rate = g(rate) = concurrency / E2E(rate), kept inside the
        bracket its evaluations give (g falls as the rate grows: g(r) > r means r is too low)."""
        lo, hi = 0.0, math.inf
        states = {}

        def g(r):
            nonlocal lo, hi
            states[r] = self.at(r)
            out = self.b / states[r].e2e_s(self.osl)  # 0 when the TTFT is unbounded
            if out > r:
                lo = max(lo, r)
            else:
                hi = min(hi, r)
            return out

        rate = self.b / (self.osl * self.step(self.b, 0) + self.chunks * self.step(self.b - 1, 1))
        for _ in range(60):
            g1 = g(rate)
            if abs(g1 - rate) <= 1e-10 * rate or (hi < math.inf and hi - lo <= 1e-10 * hi):
                break
            g2 = g(g1) if g1 > 0 else 0.0
            nxt = _aitken(rate, g1, g2)
            if not lo < nxt < hi:
                nxt = g2 if lo < g2 < hi else (lo + hi) / 2 if hi < math.inf else 2 * max(rate, g1)
            rate = nxt
        return states[rate] if rate in states else self.at(rate)


def steady_state(step, *, isl: int, osl: int, concurrency: int, budget: int, rate: float | None = None) -> Steady:
    """Steady state of one replica holding up to `concurrency` requests: closed loop, or open
    loop at `rate` requests/s (Poisson). An open-loop rate it cannot sustain comes back with
    sustainable False, its reason, TTFT inf, and TPOT and rate of the saturated replica (the
    closed loop at `concurrency`)."""
    r = _Replica(step, isl=isl, osl=osl, concurrency=concurrency, budget=budget, open_loop=rate is not None)
    if rate is None:
        return r.closed()
    s = r.at(rate)
    if s.sustainable:
        return s
    r.open = False
    return dataclasses.replace(r.closed(), ttft_s=math.inf, load=s.load, sustainable=False, why=s.why)
