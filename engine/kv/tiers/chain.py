"""TierChain: the lower tiers of the KV cache, top to bottom (host memory, local disk, a shared
store; any may be absent), as one store of block payloads under their names.

A block leaving the device pool is offloaded: the engine thread only appends it to a queue (it
must not wait for a disk or a network), and a background writer packs it into a record
(record.py) and puts it in the top tier. A tier over its capacity lets go of blocks, children
before parents (index.py), and what it lets go of goes down to the next tier, by the same
writer. A lookup counts the leading blocks of a prefix held anywhere (indexes only, one Redis
pipeline); a fetch reads them back in order, checks each record, and stops at the first miss or
bad record (counted by reason and deleted: a later lookup must not count it). A block read from
a lower tier is copied back up, again by the writer, so the next hit is nearer.

Names in the tiers are the namespace (record.namespace) then the block's name, so replicas of
another model or layout sharing a store never collide; records carry both again and are checked.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from atoll.engine.kv.tiers.record import REASONS, BadRecord, pack, unpack

log = logging.getLogger(__name__)
COUNTS = ("hits", "misses", "bytes_in", "bytes_out", "evictions", "fetch_seconds")


class TierChain:
    """The ordered lower tiers of one rank's KV cache, fed by a background writer."""

    def __init__(self, tiers: list, namespace: bytes, max_pending_bytes: int = 256 << 20,
                 write_through: bool = False):
        """tiers: top first (None entries are skipped); namespace: record.namespace(...) of this
        rank's slice. max_pending_bytes: payloads waiting for the writer past which an offload
        is dropped (counted) rather than queued, so a slow disk never grows memory unbounded.
        write_through: an offload is stored in every tier at once (the engine offloads a block as
        it is computed, so a restart finds it on disk and other replicas in the shared store), and
        a tier over capacity only lets go (what it held is below already)."""
        self.write_through = write_through
        self.tiers = [t for t in tiers if t is not None]
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names repeat: {names}")
        self.namespace, self.max_pending_bytes = namespace, max_pending_bytes
        self._counts = {n: dict(dict.fromkeys(COUNTS, 0), fetch_seconds=0.0) for n in names}
        self._bad = dict.fromkeys(REASONS, 0)
        self._dropped = 0
        self._items: deque = deque()  # (level, key, parent, payload or record, is_record)
        self._pending = self._pending_bytes = 0
        self._stopping = False
        self._lock = threading.Lock()  # the queue and the counters
        self._work = threading.Condition(self._lock)
        self._idle = threading.Condition(self._lock)
        self._warned = False
        self._thread = threading.Thread(target=self._write_loop, name="atoll-kv-tiers", daemon=True)
        self._thread.start()

    # --- the engine thread ---

    def offload(self, key: bytes, parent: bytes | None, payload) -> None:
        """Queue block `key` (child of `parent`) leaving the device; returns at once. payload:
        bytes, or an object of len() bytes whose resolve() gives them (a copy from a GPU still
        under way: engine.rank.kv_tiers.DeviceCopy), resolved by the writer."""
        self._enqueue(0, key, parent, payload, False)

    def lookup(self, keys: list[bytes]) -> int:
        """How many leading `keys` some tier holds (its index; one pipeline for Redis)."""
        held = [False] * len(keys)
        todo = list(range(len(keys)))
        for tier in self.tiers:
            if not todo:
                break
            for i, has in zip(todo, tier.has([self.namespace + keys[i] for i in todo])):
                held[i] = has
            todo = [i for i in todo if not held[i]]
        return held.index(False) if False in held else len(keys)

    def fetch(self, keys: list[bytes]) -> list[bytes]:
        """The payloads of the leading `keys` found, in order, up to the first miss or bad
        record. keys[i]'s parent is keys[i - 1] (keys[0]'s is taken as None)."""
        out: list[bytes] = []
        for i, key in enumerate(keys):
            name = self.namespace + key
            for level, tier in enumerate(self.tiers):
                start = time.perf_counter()
                data = tier.get(name)
                seconds = time.perf_counter() - start
                try:
                    payload = None if data is None else unpack(self.namespace, key, data)
                except BadRecord as e:
                    tier.delete(name)
                    with self._lock:
                        self._bad[e.reason] += 1
                        self._counts[tier.name]["misses"] += 1
                        self._counts[tier.name]["fetch_seconds"] += seconds
                    return out
                with self._lock:
                    c = self._counts[tier.name]
                    c["fetch_seconds"] += seconds
                    if payload is None:
                        c["misses"] += 1
                        continue
                    c["hits"] += 1
                    c["bytes_out"] += len(data)
                if level:  # copy it up, behind the engine's back
                    self._enqueue(-level, key, keys[i - 1] if i else None, data, True)
                out.append(payload)
                break
            else:
                return out
        return out

    def stats(self) -> dict:
        """Per tier name: enabled, blocks, bytes (None where the store alone knows), hits,
        misses, bytes_in, bytes_out, evictions, fetch_seconds; then checksum_misses by reason,
        writes_dropped and the bytes waiting for the writer."""
        with self._lock:
            out: dict = {t.name: dict(self._counts[t.name], enabled=t.enabled, blocks=t.blocks, bytes=t.bytes)
                         for t in self.tiers}
            out.update(checksum_misses=dict(self._bad), writes_dropped=self._dropped,
                       pending_bytes=self._pending_bytes)
        return out

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the queued writes; whether they all finished."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Finish the queued writes (for up to `timeout` s), stop the writer, close the tiers."""
        with self._lock:
            self._stopping = True
            self._work.notify()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            for tier in self.tiers:
                tier.close()

    def __enter__(self) -> TierChain:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the writer thread ---

    def _enqueue(self, level: int, key: bytes, parent: bytes | None, data: bytes, is_record: bool) -> None:
        """level >= 0: store from that tier down; -level: copy into every tier above `level`."""
        with self._lock:
            if not self.tiers or self._stopping or self._pending_bytes + len(data) > self.max_pending_bytes:
                self._dropped += 1
                return
            self._items.append((level, key, parent, data, is_record))
            self._pending += 1
            self._pending_bytes += len(data)
            self._work.notify()

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._items and not self._stopping:
                    self._work.wait()
                if not self._items:
                    return
                level, key, parent, data, is_record = self._items.popleft()
            try:
                payload = data if is_record or isinstance(data, bytes) else data.resolve()  # a DeviceCopy
                record = payload if is_record else pack(self.namespace, key, payload)
                name = self.namespace + key
                parent = None if parent is None else self.namespace + parent
                if level >= 0 and self.write_through:
                    self._store([(at, at + 1, name, parent, record) for at in range(len(self.tiers))])
                elif level >= 0:
                    self._store([(level, len(self.tiers), name, parent, record)])
                else:  # a promotion: a copy into each tier above the one it was found in
                    self._store([(up, up + 1, name, parent, record) for up in range(-level)])
            except Exception:  # a bug, not a full disk (the tiers take those): keep serving
                with self._lock:
                    self._dropped += 1
                if not self._warned:
                    self._warned = True
                    log.exception("KV tier writer: a block was dropped")
            finally:
                with self._lock:
                    self._pending -= 1
                    self._pending_bytes -= len(data)
                    if not self._pending:
                        self._idle.notify_all()

    def _store(self, todo: list) -> None:
        """Put each (level, stop, name, parent, record) in the first enabled tier from `level`
        to `stop` - 1 (a failed write goes on down; a promoted copy stops above where the block
        is); what a tier lets go of goes on down to the bottom (written through: it is there already)."""
        bottom = len(self.tiers)
        todo = deque(todo)
        while todo:
            level, stop, name, parent, record = todo.popleft()
            while level < stop and not self.tiers[level].enabled:
                level += 1
            if level >= stop:
                if stop == bottom:  # no tier could take it
                    with self._lock:
                        self._dropped += 1
                continue
            tier = self.tiers[level]
            below = not self.write_through and level + 1 < bottom
            stored, spilled = tier.put(name, parent, record, below)
            with self._lock:
                c = self._counts[tier.name]
                c["bytes_in"] += len(record) if stored else 0
                c["evictions"] += len(spilled)
            if not stored:
                todo.append((level + 1, stop, name, parent, record))
            if below:
                todo.extend((level + 1, bottom, n, p, r) for n, p, r in spilled if r is not None)
