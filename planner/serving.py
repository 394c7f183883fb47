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

Many replicas are solved at once, in lanes (one per layout and workload of a search): every
iteration above runs for all the lanes still iterating, as numpy arrays; each lane takes the
steps and makes the decisions it would alone, so its numbers are those of solving it alone, to
the last bit (exp and pow go through the C library, as math's do). A lane's steps come from
its layout's table of whole batches (steps.py), each row costed once for every workload.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from atoll.errors import ConfigError

_POISSON_TERMS = 50  # beyond this mean the chunk count is concentrated: its mean stands for it
# whole decode batches the cost model is asked for: every one up to _EXACT, then _SPACING apart
# (a step's time is near linear in the batch between them; this bounds the calls per layout)
_EXACT, _SPACING = 64, 0.03
# ... as one row list: a step of n sequences lies between ROWS[i] <= n < ROWS[i + 1]
ROWS = np.array(list(range(_EXACT)) + sorted({round(_EXACT * (1 + _SPACING) ** i) for i in range(500)}), float)
_WIDTH = np.diff(ROWS)
# the chunk counts a lane's Poisson series can reach before its tail is under 1e-7 (mean <= 50)
MAX_TERMS = 100


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


def _aitken(x, f1, f2):
    """Steffensen's next estimate of the fixed point x = f(x) from f1 = f(x), f2 = f(f1)
    (Aitken's delta-squared); f2 where the differences vanish. Arrays of lanes."""
    den = f2 - 2 * f1 + x
    square = np.fromiter(map(pow, (f1 - x).tolist(), itertools.repeat(2)), float, x.size)  # (f1 - x) ** 2, as math's
    return np.where(den != 0, x - square / den, f2)  # (Replicas.solve ignores x / 0)


@dataclass
class Lanes:
    """Steady states of many replicas: arrays over the lanes, as Steady's fields."""
    tpot_s: np.ndarray
    ttft_s: np.ndarray
    rate: np.ndarray
    decode_batch: np.ndarray
    chunks_per_step: np.ndarray
    load: np.ndarray
    why: list
    chunk_tokens: float
    chunk_cap: int

    @classmethod
    def empty(cls, size: int, chunk: float, cap: int) -> "Lanes":
        z = [np.zeros(size) for _ in range(6)]
        return cls(*z, why=[""] * size, chunk_tokens=chunk, chunk_cap=cap)

    def put(self, idx: np.ndarray, other: "Lanes") -> None:
        for f in ("tpot_s", "ttft_s", "rate", "decode_batch", "chunks_per_step", "load"):
            getattr(self, f)[idx] = getattr(other, f)
        for i, why in zip(idx.tolist(), other.why):
            self.why[i] = why

    def select(self, keep) -> "Lanes":
        """The lanes where `keep` (a mask) holds."""
        return Lanes(tpot_s=self.tpot_s[keep], ttft_s=self.ttft_s[keep], rate=self.rate[keep],
                     decode_batch=self.decode_batch[keep], chunks_per_step=self.chunks_per_step[keep],
                     load=self.load[keep], why=[w for w, k in zip(self.why, keep.tolist()) if k],
                     chunk_tokens=self.chunk_tokens, chunk_cap=self.chunk_cap)

    def lane(self, i: int) -> Steady:
        return Steady(tpot_s=float(self.tpot_s[i]), ttft_s=float(self.ttft_s[i]), rate=float(self.rate[i]),
                      decode_batch=float(self.decode_batch[i]), chunks_per_step=float(self.chunks_per_step[i]),
                      chunk_tokens=self.chunk_tokens, chunk_cap=self.chunk_cap, load=float(self.load[i]),
                      sustainable=not self.why[i], why=self.why[i])


def chunking(isl: int, budget: int) -> tuple[int, float, int]:
    """(chunks of one prompt, one step each; tokens of a chunk; chunks one step can carry)."""
    chunks = math.ceil(isl / budget)
    chunk = isl / chunks
    return chunks, chunk, max(1, int(budget // math.ceil(chunk)))


class Replicas:
    """The lanes' replicas: `steps` gives their steps at whole batches (steps.Tables, or Calls
    of a function), concurrency (requests a replica holds) and open_loop are arrays over the
    lanes."""

    def __init__(self, steps, *, isl: int, osl: int, concurrency, budget: int, open_loop, tokens_per_step: float = 1.0):
        """tokens_per_step: tokens a sequence gains a step (Workload.tokens_per_step: above 1
        with speculative decoding, whose steps verify several tokens)."""
        self.isl, self.osl, self.steps = isl, osl, steps
        self.per_step = tokens_per_step
        self.steps_per_request = osl / tokens_per_step  # decode steps a request takes
        self.b = np.asarray(concurrency, dtype=float)
        if self.b.size and self.b.max() >= ROWS[-2]:
            raise ConfigError(f"{self.b.max():.0f} requests on one replica: past the largest batch the planner "
                              f"costs ({ROWS[-2]:.0f})")
        self.open = np.array(open_loop, dtype=bool)
        self.chunks, self.chunk, self.cap = chunking(isl, budget)
        self.terms = min(self.cap, MAX_TERMS)  # the Poisson series' columns: 0 .. terms
        self._ks = np.arange(1, self.terms, dtype=float)
        self._lanes = np.arange(self.b.size)

    @staticmethod
    def _frac(n):
        """(row, where n lies between the row's whole batch and the next: 0 at the row)."""
        r = np.searchsorted(ROWS, n, side="right") - 1
        return r, (n - ROWS[r]) / _WIDTH[r]

    def step(self, idx, n, k):
        """Steps of n (fractional) sequences and k chunks, interpolated between whole batches
        (a step at a whole batch is its row's: + 0 x the difference)."""
        r, frac = self._frac(n)
        a, d = self.steps.at(idx, r, k)
        return a + frac * d

    def mean_step(self, idx, n, mean):
        """E[step(n, min(K, cap))], K ~ Poisson(mean), for each lane (poisson_mean's sum)."""
        if not idx.size or (mean.min() > 0 and mean.max() <= _POISSON_TERMS):
            return self._series(idx, n, mean)
        none, many = mean <= 0, mean > _POISSON_TERMS
        out = np.empty(idx.size)
        if none.any():
            out[none] = 1.0 * self.step(idx[none], n[none], 0)
        if many.any():
            out[many] = 1.0 * self.step(idx[many], n[many], np.minimum(mean[many], self.cap))
        series = ~(none | many)
        if series.any():
            out[series] = self._series(idx[series], n[series], mean[series])
        return out

    def _series(self, idx, n, mean):
        """poisson_mean's sum, term by term in its order: pmf_0 = exp(-mean), pmf_k+1 = pmf_k x
        mean/(k+1) until 1 - mass < 1e-7 at some k < cap (or k = cap - 1), then the tail."""
        t, size = self.terms, idx.size
        pmf = np.empty((size, t))
        pmf[:, 0] = np.fromiter(map(math.exp, (-mean).tolist()), float, size)
        np.divide(mean[:, None], self._ks, out=pmf[:, 1:])
        pmf = np.multiply.accumulate(pmf, axis=1)
        mass = np.add.accumulate(pmf, axis=1)
        stops = 1 - mass < 1e-7
        if t == self.cap:
            stops[:, -1] = True  # no stop before: the tail is at the cap
        elif not stops.any(axis=1).all():
            raise ValueError(f"a Poisson mean of {mean.max():.3g} chunks needs more than {t} terms")
        stop = stops.argmax(axis=1)  # the last whole term; the tail at the next
        at = stop + self._lanes[:size] * t  # flat in [lane, k < t]
        r, frac = self._frac(n)
        a, d = self.steps.upto(idx, r, t, stop + 1)  # (the prefix sums to `stop` read no column past it)
        f = a + frac[:, None] * d
        head = np.add.accumulate(pmf * f[:, :t], axis=1).take(at)
        return head + (1 - mass.take(at)) * f[:, 1:].take(at)

    def at(self, idx, rate) -> Lanes:
        """The lanes' steady states at `rate` requests/s each."""
        b, osl, open_ = self.b[idx], self.steps_per_request, self.open[idx]  # (osl: a request's steps)
        others_rate = np.where(open_, rate, rate * (b - 1) / b)
        # the lanes still iterating, and their terms: requests decoding beside this one (Little)
        # are min(b - 1, others_rate * osl * t), chunks arriving during a step of t others_rate * t * chunks
        live, ids, most, per_t, rates = np.arange(idx.size), idx, b - 1, others_rate * osl, others_rate

        def mean_step(t):  # the mean step when a step takes t: its chunks arrive during it
            return self.mean_step(ids, 1 + np.minimum(most, per_t * t), rates * t * self.chunks)

        tpot = self.step(idx, np.ones(idx.size), 0)
        t = tpot
        for _ in range(50):  # Steffensen's iteration (Aitken's delta-squared) on tpot = mean_step(tpot)
            f1 = mean_step(t)
            done = np.abs(f1 - t) <= 1e-10 * t
            if done.any():
                tpot[live[done]] = f1[done]
                keep = ~done
                live, ids, most, per_t, rates = live[keep], ids[keep], most[keep], per_t[keep], rates[keep]
                if not live.size:
                    break
                t, f1 = t[keep], f1[keep]
            f2 = mean_step(f1)
            nxt = _aitken(t, f1, f2)
            t = np.where((0 < nxt) & (nxt < math.inf), nxt, f2)
            tpot[live] = t
        others = np.minimum(b - 1, others_rate * osl * tpot)
        full = self.step(idx, 1 + others, self.cap)  # a step carrying all the prompt tokens it can
        service = self.isl * full / (self.cap * self.chunk)
        load = rate * service
        rho = others_rate * service  # the prompts ahead of this one come from the other clients
        wait = np.where(rho >= 1, math.inf, rho * service / (2 * (1 - rho)))  # md1_wait
        ttft = np.where(others > 0, tpot / 2, 0.0) + wait + self.chunks * self.step(idx, others, 1)
        busy = rate * osl * tpot
        why = [""] * idx.size
        for i in np.flatnonzero(open_ & ((load >= 1) | (busy > b))).tolist():
            why[i] = (f"prompts arrive faster than the steps prefill them (prefill load {load[i]:.2f} >= 1 "
                      f"at {rate[i]:.3g} requests/s per replica)" if load[i] >= 1 else
                      f"{busy[i]:.0f} requests would be decoding at once per replica, more than "
                      f"the {int(b[i])} the KV cache is planned for")
            ttft[i] = math.inf
        return Lanes(tpot_s=tpot / self.per_step, ttft_s=ttft, rate=np.asarray(rate, dtype=float), decode_batch=1 + others,
                     chunks_per_step=others_rate * tpot * self.chunks, load=load, why=why,
                     chunk_tokens=self.chunk, chunk_cap=self.cap)

    def closed(self, idx) -> Lanes:
        """The closed loop's fixed point: rate * (TTFT + osl * TPOT) = concurrency, by
        Steffensen's iteration on rate = g(rate) = concurrency / E2E(rate), kept inside the
        bracket its evaluations give (g falls as the rate grows: g(r) > r means r is too low)."""
        b, osl = self.b[idx], self.osl
        lo, hi = np.zeros(idx.size), np.full(idx.size, math.inf)
        out = Lanes.empty(idx.size, self.chunk, self.cap)

        def g(i, r):
            st = self.at(idx[i], r)
            v = b[i] / (st.ttft_s + osl * st.tpot_s)  # 0 when the TTFT is unbounded
            up = v > r
            lo[i[up]] = np.maximum(lo[i[up]], r[up])
            hi[i[~up]] = np.minimum(hi[i[~up]], r[~up])
            return v, st

        rate = b / (self.steps_per_request * self.step(idx, b, 0) + self.chunks * self.step(idx, b - 1, 1))
        live = np.arange(idx.size)
        for _ in range(60):
            if not live.size:
                break
            r = rate[live]
            g1, st = g(live, r)
            done = (np.abs(g1 - r) <= 1e-10 * r) | ((hi[live] < math.inf) & (hi[live] - lo[live] <= 1e-10 * hi[live]))
            out.put(live[done], st.select(done))
            live, r, g1 = live[~done], r[~done], g1[~done]
            g2 = np.zeros(live.size)
            pos = g1 > 0
            if pos.any():
                g2[pos] = g(live[pos], g1[pos])[0]
            nxt = _aitken(r, g1, g2)
            l, h = lo[live], hi[live]
            inside = (l < nxt) & (nxt < h)
            other = np.where((l < g2) & (g2 < h), g2, np.where(h < math.inf, (l + h) / 2, 2 * np.maximum(r, g1)))
            rate[live] = np.where(inside, nxt, other)
        if live.size:
            out.put(live, self.at(idx[live], rate[live]))
        return out

    def solve(self, rates=None) -> Lanes:
        """Every lane's steady state: closed loop, or open loop at `rates` (an array; NaN for a
        closed-loop lane). An open-loop rate a lane cannot sustain comes back with its reason,
        TTFT inf, and TPOT and rate of the saturated replica (the closed loop). Divisions by
        zero and their NaNs stay in lanes np.where leaves out: numpy is told not to warn."""
        with np.errstate(divide="ignore", invalid="ignore"):
            return self._solve(rates)

    def _solve(self, rates) -> Lanes:
        n = self.b.size
        out = Lanes.empty(n, self.chunk, self.cap)
        every = np.arange(n)
        opened = self.open.copy()
        if (~opened).any():
            out.put(every[~opened], self.closed(every[~opened]))
        if opened.any():
            idx = every[opened]
            s = self.at(idx, np.asarray(rates, dtype=float)[idx])
            out.put(idx, s)
            bad = np.array([bool(w) for w in s.why])
            if bad.any():
                self.open[idx[bad]] = False
                c = self.closed(idx[bad])
                c.ttft_s[:] = math.inf
                c.load, c.why = s.load[bad], [w for w in s.why if w]
                out.put(idx[bad], c)
        self.open = opened
        return out


class Calls:
    """Steps from a function step(n, k, length) (steady_state's), each asked once."""

    def __init__(self, step, chunk: float):
        self.f, self.chunk, self.memo = step, chunk, {}

    def _one(self, row: int, k) -> float:
        key = (row, k)
        if key not in self.memo:
            self.memo[key] = self.f(int(ROWS[row]), k, self.chunk)
        return self.memo[key]

    def at(self, idx, r, k):
        ks = [c if c != int(c) else int(c) for c in np.broadcast_to(np.asarray(k), idx.shape).tolist()]
        a = np.array([self._one(x, c) for x, c in zip(r.tolist(), ks)], dtype=float)
        b = np.array([self._one(x + 1, c) for x, c in zip(r.tolist(), ks)], dtype=float)
        return a, b - a

    def upto(self, idx, r, last: int, needed=None):
        """k = 0 .. last; past a lane's `needed` column, NaN (never read)."""
        ends = [last] * r.size if needed is None else needed.tolist()

        def row(x, end):
            return [self._one(x, k) if k <= end else np.nan for k in range(last + 1)]

        a = np.array([row(x, e) for x, e in zip(r.tolist(), ends)])
        b = np.array([row(x + 1, e) for x, e in zip(r.tolist(), ends)])
        return a, b - a


def steady_state(step, *, isl: int, osl: int, concurrency: int, budget: int, rate: float | None = None,
                 tokens_per_step: float = 1.0) -> Steady:
    """Steady state of one replica holding up to `concurrency` requests: closed loop, or open
    loop at `rate` requests/s (Poisson). An open-loop rate it cannot sustain comes back with
    sustainable False, its reason, TTFT inf, and TPOT and rate of the saturated replica (the
    closed loop at `concurrency`). step(n, k, length): a step of n whole sequences and k chunks
    of `length` tokens; tokens_per_step: what a sequence gains a step (speculation: above 1)."""
    r = Replicas(Calls(step, chunking(isl, budget)[1]), isl=isl, osl=osl, concurrency=[concurrency], budget=budget,
                 open_loop=[rate is not None], tokens_per_step=tokens_per_step)
    return r.solve(None if rate is None else [rate]).lane(0)
