"""A step's seconds by name, for one step or for many at once, and the arithmetic both share.

The cost model (cost.py, moe_cost.py, collectives.py) is written once. Given plain numbers it
runs as always and `Parts` is a dict of seconds by name. Given numpy arrays of batches and
chunk counts it costs every one of those steps in one pass and `Many` holds an array per name:
the search costs a layout's whole table of steps (steps.py) in one call.

Both give the same numbers, to the last bit. Each name's seconds are added in the same order
either way (a step an op does not touch adds an exact +0.0), and a step's total is the sum of
its names in the order a dict of that step would hold them: `Many` records where each name
was first touched for each step and sums in that order (float addition is not associative).
The helpers below are max, min, ceil and a choice, on numbers or arrays.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from atoll.planner.categories import COMPUTE

_TOUCH = itertools.count()  # the order names are first touched in, across every Many


def is_many(*xs) -> bool:
    return any(isinstance(x, np.ndarray) for x in xs)


def vmax(a, b):
    return np.maximum(a, b) if is_many(a, b) else max(a, b)


def vmin(a, b):
    return np.minimum(a, b) if is_many(a, b) else min(a, b)


def vceil(x):
    return np.ceil(x) if is_many(x) else math.ceil(x)


def vwhere(cond, a, b):
    return np.where(cond, a, b) if is_many(cond, a, b) else (a if cond else b)


def vnot(cond):
    return ~cond if is_many(cond) else not cond


def vany(cond) -> bool:
    return bool(np.any(cond))


def vall(cond) -> bool:
    return bool(np.all(cond))


_POW = np.frompyfunc(pow, 2, 1)


def vpow(x, y):
    """x ** y, for arrays too through the C library's pow, as for numbers: numpy's own pow
    may differ from it in the last bit. An array's distinct values are raised once each."""
    if not is_many(x, y):
        return x ** y
    if is_many(x) and is_many(y):
        return _POW(x, y).astype(float)
    values, back = np.unique(x if is_many(x) else y, return_inverse=True)
    return (_POW(values, y) if is_many(x) else _POW(x, values)).astype(float)[back]


class Parts(dict):
    """Seconds by name of one step (or pass); a name not yet held reads 0.0, as in a
    defaultdict(float)."""

    def __missing__(self, name: str) -> float:
        return 0.0

    def add(self, name: str, seconds, when=True) -> None:
        if when:
            self[name] = self.get(name, 0.0) + seconds

    def add_op(self, kind: str, t_mem, t_cmp, when=True) -> None:
        """An op bound by memory (charged to `kind`) or by compute, whichever is slower."""
        if when:
            name = kind if t_mem >= t_cmp else COMPUTE
            self[name] = self.get(name, 0.0) + max(t_mem, t_cmp)

    def merge(self, other: "Parts", times=None) -> None:
        for name, v in other.items():
            self[name] = self.get(name, 0.0) + (v if times is None else v * times)

    def total(self):
        return sum(self.values())


class Many:
    """Seconds by name of `size` steps at once: an array (or one number for all) per name, and
    for each step where the name was first touched: one touch for all the steps, or an array
    of them (inf: never, the step has no such name) with the set of touches it holds."""

    def __init__(self, size: int):
        self.size = size
        self.v: dict[str, object] = {}
        self.first: dict[str, object] = {}
        self.touches: dict[str, set] = {}  # of the names whose first touch differs by step

    def add(self, name: str, seconds, when=True) -> None:
        if isinstance(when, np.ndarray):
            if when.all():
                when = True
            elif not when.any():
                return
        elif not when:
            return
        touch = next(_TOUCH)
        if name not in self.v:
            if when is True:
                self.v[name], self.first[name] = 0.0 + seconds, touch
            else:
                self.v[name], self.first[name] = np.where(when, seconds, 0.0), np.where(when, touch, np.inf)
                self.touches[name] = {touch}
            return
        self.v[name] = self.v[name] + (seconds if when is True else np.where(when, seconds, 0.0))
        if name in self.touches:  # a name every step has had from its first touch keeps it
            first = np.minimum(self.first[name], touch)
            self.first[name] = first if when is True else np.where(when, first, self.first[name])
            self.touches[name].add(touch)

    def add_op(self, kind: str, t_mem, t_cmp, when=True) -> None:
        slower = np.maximum(t_mem, t_cmp)
        mem = t_mem >= t_cmp
        if when is not True:
            mem, cmp = mem & when, ~mem & when
        elif mem.all():  # every step bound by memory: one name
            self.add(kind, slower)
            return
        else:
            cmp = ~mem
        self.add(kind, slower, mem)
        self.add(COMPUTE, slower, cmp)

    def merge(self, other: "Many", times=None) -> None:
        for name, v in other.v.items():
            v = v if times is None else v * times  # 0 where other lacks the name
            a, b = self.first.get(name), other.first[name]
            if a is None:  # 0.0 + v is v (arrays are never changed in place: shared)
                self.v[name], self.first[name] = v, b
                if name in other.touches:
                    self.touches[name] = set(other.touches[name])
                continue
            self.v[name] = self.v[name] + v
            if name in self.touches or name in other.touches:
                self.first[name] = np.minimum(a, b)
                self.touches[name] = ((self.touches[name] if name in self.touches else {a})
                                      | (other.touches[name] if name in other.touches else {b}))
            else:
                self.first[name] = min(a, b)

    def total(self) -> np.ndarray:
        """Each step's seconds, its names summed in their order of first touch: the names'
        first touches in time order, each adding to the steps it was first for."""
        events = []
        for name, first in self.first.items():
            for touch in self.touches.get(name, (first,)):
                events.append((touch, name))
        total = np.zeros(self.size)
        for touch, name in sorted(events):
            v = self.v[name]
            total = total + (v if name not in self.touches else np.where(self.first[name] == touch, v, 0.0))
        return total

    def singles(self) -> list[dict]:
        """Every step's seconds by name, as a dict of that one step would hold them."""
        names = list(self.v)
        values = np.empty((len(names), self.size))
        first = np.empty((len(names), self.size))
        for j, n in enumerate(names):
            values[j], first[j] = self.v[n], self.first[n]
        order = np.argsort(first, axis=0, kind="stable")
        steps = np.arange(self.size)[None, :]
        values, held = values[order, steps], np.isfinite(first[order, steps])
        out = []
        for i in range(self.size):
            rows = np.flatnonzero(held[:, i])
            out.append(dict(zip([names[j] for j in order[rows, i].tolist()], values[rows, i].tolist())))
        return out


def parts_for(*xs):
    """An empty Parts, or a Many as wide as the arrays among xs."""
    for x in xs:
        if isinstance(x, np.ndarray):
            return Many(x.size)
    return Parts()
