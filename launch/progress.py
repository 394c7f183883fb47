"""A progress bar with tokens/s, fed by rank 0 through a queue (local processes) or
directly (rank 0 under torchrun or mpirun)."""

from __future__ import annotations

import queue
import threading
import time


class ProgressBar:
    """put((done, tokens)) from anywhere; a tqdm bar over the requests shows tokens/s."""

    def __init__(self, total: int, *, channel=None, enabled: bool = True):
        from tqdm import tqdm

        self.channel = channel  # a multiprocessing queue, or None to be fed by put()
        self._bar = tqdm(total=total, unit="req", disable=not enabled, dynamic_ncols=True, mininterval=0.5)
        self._start = time.perf_counter()
        self._stop = threading.Event()
        self._thread = None
        if channel is not None:
            self._thread = threading.Thread(target=self._drain, daemon=True)
            self._thread.start()

    def put(self, item) -> None:
        done, tokens = item
        rate = tokens / max(time.perf_counter() - self._start, 1e-9)
        self._bar.set_postfix_str(f"{tokens} tok, {rate:.1f} tok/s", refresh=False)
        self._bar.update(done - self._bar.n)  # redraws at most every mininterval

    def _drain(self) -> None:
        while not self._stop.is_set():
            try:
                self.put(self.channel.get(timeout=0.2))
            except queue.Empty:
                continue
            except (EOFError, OSError):
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        self._bar.close()
