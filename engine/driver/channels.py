"""One reader over several channels. A disaggregated job's engines each answer the driver on a
channel of their own, read here by one thread each into one queue, so that a rank killed while
it writes loses only its own engine's channel.

Why: a multiprocessing queue shared by several writer processes is lost with any of them that
dies mid-put. The writer's feeder thread holds the queue's write lock while it writes, and a
message larger than what the pipe has room for goes in pieces as the reader drains it; a
SIGKILL between the pieces leaves the lock taken (every other writer's messages wait behind it
for ever) and half a message in the pipe (the reader, having read its length, waits for the
rest for ever). With one channel for all engines, a decode engine killed while the driver was
slow to read (a loaded machine: the pipe full) froze the surviving engines' streams.
"""

from __future__ import annotations

import queue
import threading


class Merged:
    """get / get_nowait over `channels` (queues with get(timeout=...)), in each channel's own
    order; the order between channels is the order their messages are read."""

    def __init__(self, channels: list, poll_s: float = 0.2):
        self.channels, self.poll_s = list(channels), poll_s
        self._queue: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> Merged:
        """Start reading (once the job holding the channels has started: a Ray channel is made on first use)."""
        for k, channel in enumerate(self.channels):
            t = threading.Thread(target=self._forward, args=(channel,), daemon=True, name=f"atoll-outbox-{k}")
            t.start()
            self._threads.append(t)
        return self

    def _forward(self, channel) -> None:
        # a channel whose writer died mid-message keeps its thread in the read below for good:
        # a daemon thread blocked on a pipe nobody writes, which stops nothing else
        while not self._closed.is_set():
            try:
                msg = channel.get(timeout=self.poll_s)
            except queue.Empty:
                continue
            except (OSError, EOFError, ValueError, RuntimeError):  # the channel is closed or its job gone
                return
            self._queue.put(msg)

    def get(self, block: bool = True, timeout: float | None = None):
        return self._queue.get(block, timeout)

    def get_nowait(self):
        return self._queue.get_nowait()

    def close(self) -> None:
        """The readers stop within poll_s (one stuck on a dead writer's half message stays)."""
        self._closed.set()
