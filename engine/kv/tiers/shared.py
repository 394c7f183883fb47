"""The shared tier: a store every replica reads, so a prefix one replica computed is a fetch
for the others (and for a replica started later).

Two kinds, by URL. `file:///path` is a directory on a shared filesystem holding the disk tier's
record files (disk.py): a rename is atomic, so several processes may write at once. With no
capacity nothing is deleted; whoever sizes the filesystem sizes the tier. `redis://host:port[/db]`
is a Redis server (redis-py), a record per key `atoll:kv:<namespace hex><block hex>`; Redis's own
maxmemory policy is its capacity. A store that stops answering (refused, timed out, killed)
must not stop the server: every call is short (sub-second socket timeouts, no client retries),
the first failure turns the tier off with one warning, and a call after a back-off tries again.
"""

from __future__ import annotations

import logging
import threading
import time
from urllib.parse import unquote, urlsplit

from atoll.engine.kv.tiers.disk import DiskTier
from atoll.engine.kv.tiers.host import Spilled
from atoll.errors import ConfigError

PREFIX = b"atoll:kv:"
BACKOFF_S = 10.0
log = logging.getLogger(__name__)


class SharedTier:
    """Opens the shared tier a URL names."""

    @staticmethod
    def open(url: str, capacity_bytes: int | None = None):
        """A DiskTier named "shared" for file:///path, a RedisTier for redis://host:port[/db];
        ConfigError for anything else."""
        parts = urlsplit(url)
        if parts.scheme == "file":
            if parts.netloc not in ("", "localhost") or not parts.path:
                raise ConfigError(f"KV shared tier {url!r}: a file URL is file:///absolute/path")
            return DiskTier(unquote(parts.path), capacity_bytes, name="shared", shared=True)
        if parts.scheme == "redis":
            if capacity_bytes is not None:
                raise ConfigError(f"KV shared tier {url}: Redis sizes itself (its maxmemory), give no capacity")
            return RedisTier(url)
        raise ConfigError(f"KV shared tier {url!r}: the URL is file:///path or redis://host:port[/db]")


class RedisTier:
    """Block records in Redis. Never raises into its caller: a failure is a miss (or a write
    not made) and turns the tier off for BACKOFF_S."""

    name = "shared"
    blocks = None  # the server's to know (INFO), not this process's
    bytes = None

    def __init__(self, url: str, timeout_s: float = 1.0, backoff_s: float = BACKOFF_S):
        try:  # lazy: redis-py is the optional extra atoll[kv]
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise ConfigError(f"KV shared tier {url}: needs the redis package (pip install 'atoll[kv]')") from None
        try:
            self._client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                                socket_connect_timeout=min(timeout_s, 0.5),
                                                retry=Retry(NoBackoff(), 0))
        except ValueError as e:
            raise ConfigError(f"KV shared tier {url}: {e}") from None
        self.url, self.backoff_s = url, backoff_s
        self._errors = (redis.RedisError, OSError)
        self._down_until = 0.0  # monotonic time before which no call is made
        self._down = False
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return not self._down

    def _key(self, name: bytes) -> bytes:
        return PREFIX + name.hex().encode()

    def _call(self, fn, default):
        """fn()'s answer, or `default` while the server is off or when it fails."""
        if self._down and time.monotonic() < self._down_until:
            return default
        try:
            answer = fn()
        except self._errors as e:
            with self._lock:
                self._down_until = time.monotonic() + self.backoff_s
                if not self._down:
                    self._down = True
                    log.warning("KV tier shared (%s) is off: %s; retried every %g s, serving goes on",
                                self.url, str(e).rstrip("."), self.backoff_s)
            return default
        self._down = False
        return answer

    def has(self, names: list[bytes]) -> list[bool]:
        """Whether each name is stored: one pipeline of EXISTS; all False while off."""
        def ask():
            pipe = self._client.pipeline(transaction=False)
            for n in names:
                pipe.exists(self._key(n))
            return [bool(x) for x in pipe.execute()]
        return self._call(ask, [False] * len(names)) if names else []

    def get(self, name: bytes) -> bytes | None:
        return self._call(lambda: self._client.get(self._key(name)), None)

    def put(self, name: bytes, parent: bytes | None, record: bytes, spill: bool) -> tuple[bool, Spilled]:
        """SET the record; (False, []) when the server is off or fails."""
        return self._call(lambda: bool(self._client.set(self._key(name), record)), False), []

    def delete(self, name: bytes) -> None:
        self._call(lambda: self._client.delete(self._key(name)), None)

    def close(self) -> None:
        self._client.close()
