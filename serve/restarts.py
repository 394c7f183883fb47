"""Engines come back: when a replica's ranks die, serve.replicas starts it again on the same
resources under a RestartPolicy, in a thread of its own, while the live replicas serve.

--restart-policy never|on-failure (default on-failure) and --max-restarts N: at most N restarts
of one engine within --restart-window-s seconds, the k-th after a backoff of
min(backoff_s * 2**(k-1), max_backoff_s). An engine that fails more often than that stays down,
and /health names it with the last cause ("crash loop").
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from atoll.errors import InputError

RESTART_POLICIES = ("never", "on-failure")


@dataclass(frozen=True)
class RestartPolicy:
    policy: str = "on-failure"
    max_restarts: int = 3  # within window_s, per engine
    window_s: float = 600.0
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def __post_init__(self):
        if self.policy not in RESTART_POLICIES:
            raise InputError(f"--restart-policy {self.policy!r}: choose one of {', '.join(RESTART_POLICIES)}")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise InputError(f"--max-restarts {self.max_restarts!r} must be a whole number of at least 0")
        for name in ("window_s", "backoff_s", "max_backoff_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise InputError(f"{name}={value!r} must be a number >= 0")

    @property
    def restarts(self) -> bool:
        return self.policy == "on-failure" and self.max_restarts > 0


class Restarts:
    """Each engine's recent restarts, and whether (and after how long) the next may start."""

    def __init__(self, policy: RestartPolicy, engines: int):
        self.policy = policy
        self._times: list[deque] = [deque() for _ in range(engines)]
        self._lock = threading.Lock()

    def next_backoff(self, engine: int, now: float | None = None) -> float | None:
        """Seconds to wait before restarting `engine`, counting this restart; None: it may not
        (policy never, or max_restarts within the window already)."""
        if not self.policy.restarts:
            return None
        now = time.monotonic() if now is None else now
        with self._lock:
            times = self._times[engine]
            while times and now - times[0] > self.policy.window_s:
                times.popleft()
            if len(times) >= self.policy.max_restarts:
                return None
            times.append(now)
            k = len(times)
        return min(self.policy.backoff_s * 2 ** (k - 1), self.policy.max_backoff_s)

    def count(self, engine: int) -> int:
        with self._lock:
            return len(self._times[engine])
