"""A progress bar for a search that takes a while: plan_sweep's progress(done, total) drawn by
tqdm on stderr, only once the search has run `delay` seconds (a plan that answers in under a
second shows none) and only where stderr is a terminal.

    with SearchProgress(enabled=not args.no_progress) as progress:
        plans = plan_sweep(config, topology, workloads, progress=progress)
"""

from __future__ import annotations

import sys

from tqdm import tqdm


class SearchProgress:
    """progress(done, total): steps of costing done so far (search.evaluate_all counts two a
    layout: its table of steps, then its mean step's parts). enabled False: no bar; None or
    True: a bar when stderr is a terminal."""

    def __init__(self, *, enabled: bool | None = True, delay: float = 1.0, file=None):
        file = file or sys.stderr
        shown = enabled is not False and file.isatty()
        self._bar = tqdm(total=0, desc="costing layouts", unit="step", file=file, disable=not shown,
                         delay=delay, leave=False, dynamic_ncols=True, mininterval=0.2)

    def __call__(self, done: int, total: int) -> None:
        if self._bar.total != total:
            self._bar.total = total
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> "SearchProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
