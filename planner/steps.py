"""Each layout's decode steps, costed once: a table of step seconds by whole batch and chunk count.

Steady serving (serving.py) asks for steps of n sequences carrying k prompt chunks, n between
the whole batches of serving.ROWS. None of that depends on the concurrency, so a search costs
every row a layout's replicas can reach (up to the largest batch of any workload it is asked
about), for every chunk count its Poisson series can reach, in one vectorised pass of the cost
model (CostModel.step_times), and every lane of that layout reads the table. A chunk count
off the table (a fractional mean above serving._POISSON_TERMS, when a step carries more than
MAX_TERMS chunks) is costed when asked for, one step at a time.
"""

from __future__ import annotations

import numpy as np

from atoll.planner.serving import MAX_TERMS, ROWS


def columns(cap: int) -> list[int]:
    """The chunk counts a table holds: 0 .. the Poisson series' last term, and the cap (a
    full-budget step)."""
    terms = min(cap, MAX_TERMS)
    return list(range(terms + 1)) + ([cap] if cap > terms else [])


def rows_for(batch: int) -> int:
    """Rows of serving.ROWS a replica of `batch` requests reaches: up to the one above `batch`."""
    return int(np.searchsorted(ROWS, batch, side="right")) + 1


class Tables:
    """Step tables of many layouts, one per cost model, in one array [layout, row, column];
    `lay` maps each lane to its layout. A cost model that costs steps one at a time (a
    calibrated machine: CostModel.vectorises) fills its rows as the lanes reach them."""

    def __init__(self, costs: list, batches: list[int], *, chunk: float, cap: int, lay, progress=None):
        self.costs, self.chunk, self.lay = costs, chunk, np.asarray(lay)
        self.cols = columns(cap)
        self.col = {k: i for i, k in enumerate(self.cols)}
        width = len(self.cols)
        height = max(rows_for(b) for b in batches)
        self.t = np.full((len(costs), height, width), np.nan)
        self.filled = np.zeros((len(costs), height, width), bool)
        for i, (cm, b) in enumerate(zip(costs, batches)):
            if cm.vectorises:
                rows = rows_for(b)
                n = np.repeat(ROWS[:rows], width)
                k = np.tile(np.asarray(self.cols, dtype=float), rows)
                self.t[i, :rows] = cm.step_times(n, k, chunk).reshape(rows, width)
                self.filled[i, :rows] = True
            if progress is not None:
                progress(1)
        self.lazy = not all(cm.vectorises for cm in costs)
        # [layout, row, (the step, the next row's less it), column]: one gather reads both
        self.td = np.full((len(costs), height, 2, width), np.nan)
        self.td[:, :, 0] = self.t
        self.td[:, :-1, 1] = self.t[:, 1:] - self.t[:, :-1]
        self._off: dict = {}

    def at(self, idx, r, k):
        """(seconds of the step of ROWS[r] sequences and k chunks, the next row's less that):
        k a whole count, or one per lane."""
        li = self.lay[idx]
        if np.isscalar(k) and k in self.col:
            if self.lazy:
                self._fill(li, r, np.full(li.size, self.col[k]), one=True)
            x = self.td[li, r, :, self.col[k]]
            return x[:, 0], x[:, 1]
        ks = np.broadcast_to(np.asarray(k, dtype=float), idx.shape).tolist()
        a = np.array([self._step(x, y, c) for x, y, c in zip(li.tolist(), r.tolist(), ks)])
        b = np.array([self._step(x, y + 1, c) for x, y, c in zip(li.tolist(), r.tolist(), ks)])
        return a, b - a

    def upto(self, idx, r, last: int, needed=None):
        """The same for k = 0 .. last chunks: [lane, k] arrays. needed: each lane's last
        column read (a table filled as asked for leaves the others unknown)."""
        li = self.lay[idx]
        if self.lazy:
            self._fill(li, r, np.full(li.size, last) if needed is None else needed)
        x = self.td[li, r, :, :last + 1]
        return x[:, 0], x[:, 1]

    def _fill(self, li, r, last, one: bool = False) -> None:
        """Rows r and r + 1 of the layouts li, columns up to `last` (or `last` alone), costed
        where not yet."""
        for layout, row, end in sorted(set(zip(li.tolist(), r.tolist(), last.tolist()))):
            cols = [end] if one else range(end + 1)
            for at in (row, row + 1):
                for c in cols:
                    if not self.filled[layout, at, c]:
                        k = self.cols[c]  # (a step of nothing, no batch and no chunk, is never asked for)
                        self.t[layout, at, c] = self.costs[layout].decode(int(ROWS[at]), k, self.chunk)[0] \
                            if at or k else np.nan
                        self.filled[layout, at, c] = True
            for j in range(max(0, row - 1), min(row + 2, self.t.shape[1])):  # the rows whose differences changed
                self.td[layout, j, 0] = self.t[layout, j]
                if j + 1 < self.t.shape[1]:
                    self.td[layout, j, 1] = self.t[layout, j + 1] - self.t[layout, j]

    def _step(self, layout: int, row: int, k: float) -> float:
        if k in self.col:
            c = self.col[k]
            if self.lazy and not self.filled[layout, row, c]:  # a table filled as asked for
                self._fill(np.array([layout]), np.array([row]), np.array([c]), one=True)
            return float(self.t[layout, row, c])
        key = (layout, row, k)
        if key not in self._off:  # off the table: costed when asked for
            self._off[key] = self.costs[layout].decode(int(ROWS[row]), k, self.chunk)[0]
        return self._off[key]
