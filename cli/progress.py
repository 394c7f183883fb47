"""The progress bar `atoll generate` feeds from the engine's stream (requests done, tokens made)."""

from __future__ import annotations

import time

from tqdm import tqdm


class ProgressBar:
    """put((done, tokens)); a tqdm bar over the requests shows tokens/s."""

    def __init__(self, total: int, *, enabled: bool = True):
        self._bar = tqdm(total=total, unit="req", disable=not enabled, dynamic_ncols=True, mininterval=0.5)
        self._start = None  # the first step's report: tokens/s counts generation, not start-up

    def put(self, item) -> None:
        done, tokens = item
        now = time.perf_counter()
        if self._start is None:
            self._start = (now, tokens)  # tokens/s counts what came after the first report
        elapsed = now - self._start[0]
        rate = f"{(tokens - self._start[1]) / elapsed:.1f} tok/s" if elapsed > 0.05 else "- tok/s"
        self._bar.set_postfix_str(f"{tokens} tok, {rate}", refresh=False)
        self._bar.update(done - self._bar.n)  # redraws at most every mininterval

    def close(self) -> None:
        self._bar.close()
