"""Step tables (planner/steps.py) of a cost model that costs one step at a time (a calibrated
machine) are filled as the lanes ask for them: every way of reading one, by a whole chunk count
or one per lane, reads a costed step, never an unfilled cell."""

from __future__ import annotations

import math

import numpy as np

from atoll.planner.serving import ROWS
from atoll.planner.steps import Tables


class OneAtATime:
    """A cost model that does not vectorise: a step is 10 ms + 1 ms a sequence + 50 ms a chunk."""
    vectorises = False

    def decode(self, batch: int, chunks: float, chunk_tokens: float):
        return 0.010 + 0.001 * batch + 0.050 * chunks, {}, 1


def test_a_lazy_table_read_per_lane_costs_what_it_reads():
    t = Tables([OneAtATime()], [64], chunk=256, cap=4, lay=[0, 0, 0])
    idx = np.array([0, 1, 2])
    r = np.searchsorted(ROWS, [1, 16, 40], side="right") - 1
    a, d = t.at(idx, r, np.array([0.0, 1.0, 2.0]))  # one chunk count per lane: read cell by cell
    want = [0.010 + 0.001 * ROWS[i] + 0.050 * k for i, k in zip(r, (0, 1, 2))]
    assert np.allclose(a, want) and all(math.isfinite(x) for x in d)
    a1, _ = t.at(idx, r, 1)  # a whole count for every lane: the same cells as the fill makes them
    assert np.allclose(a1, [0.010 + 0.001 * ROWS[i] + 0.050 for i in r])
