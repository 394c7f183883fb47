"""What rank 0 reports while it runs, and the progress bar it feeds.

Rank 0 puts ("step", requests done, tokens made) after each step and ("done", index, result)
as each request finishes (engine.rank.worker). `Reports` takes them in the parent: from a
multiprocessing queue drained by a thread (local ranks), or through put() directly (rank 0
under torchrun or mpirun, which is the parent). Steps go to the bar, finished requests to a
callback that writes them out at once, so a crash keeps what was done."""

from __future__ import annotations

import queue
import threading
import time


class ProgressBar:
    """put((done, tokens)); a tqdm bar over the requests shows tokens/s."""

    def __init__(self, total: int, *, enabled: bool = True):
        from tqdm import tqdm

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


class Reports:
    """The parent's end of rank 0's reports: steps to `bar` (or nowhere), finished requests
    to `on_done(index, result)`. With `channel` (a multiprocessing queue) a thread drains it
    until close(), which first takes everything already in the queue."""

    def __init__(self, *, bar: ProgressBar | None = None, on_done=None, channel=None):
        self.bar, self.on_done, self.channel = bar, on_done, channel
        self._stop = threading.Event()
        self._thread = None
        if channel is not None:
            self._thread = threading.Thread(target=self._drain, daemon=True)
            self._thread.start()

    def put(self, item) -> None:
        kind, *rest = item
        if kind == "step" and self.bar is not None:
            self.bar.put(rest)
        elif kind == "done" and self.on_done is not None:
            self.on_done(*rest)

    def _drain(self) -> None:
        while True:
            try:
                item = self.channel.get(timeout=0.2)
            except queue.Empty:
                if self._stop.is_set():
                    return  # stopped, and nothing left in the queue
                continue
            except (EOFError, OSError, ValueError):
                return
            try:
                self.put(item)
            except Exception:  # noqa: BLE001 -- the parent writes whatever this missed at the end
                pass

    def close(self, timeout_s: float = 5.0) -> None:
        """Take what is still queued (a rank that died may have left a message half-written:
        the wait is bounded), then close the bar."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        if self.channel is not None and hasattr(self.channel, "close"):
            self.channel.close()  # this process's end; its feeder thread and locks go with it
            self.channel.join_thread()
        if self.bar is not None:
            self.bar.close()
