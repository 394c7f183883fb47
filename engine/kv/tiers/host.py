"""The host-memory tier: block records in this process's memory, the first stop of a block
the device pool lets go of. A hit here costs a copy back to the device instead of a prefill.

Every tier has the same small surface, which the chain (chain.py) drives: `name`, `enabled`
(takes writes), `blocks` and `bytes` held (None where unknown), `has(names)`, `get(name)`,
`put(name, parent, record, spill) -> (stored, spilled)`, `delete(name)` and `close()`. Names are
opaque bytes (the chain's namespace then the block's name); records are record.py's, unread here.
`put` stores a record and lets go of least-recently-used leaves (index.py) until the tier is
back under its capacity; it returns whether the write happened (False: a failed write, the
record goes on down) and what it let go of, each `(name, parent, record)`, oldest first (the
record just put among them when it ends the only chain), the record read back only when `spill`
(a tier below will take it).
"""

from __future__ import annotations

import threading

from atoll.engine.kv.tiers.index import Indexed, PrefixLRU

Spilled = list[tuple[bytes, bytes | None, bytes | None]]  # (name, parent, record or None)


class HostTier(Indexed):
    """Records in a dict, at most `capacity_bytes` of them (header included)."""

    name = "host"

    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes={capacity_bytes} is negative")
        self.capacity_bytes = capacity_bytes
        self.enabled = True
        self._records: dict[bytes, bytes] = {}
        self._index = PrefixLRU()
        self._lock = threading.Lock()  # the writer thread puts while the engine thread gets

    def has(self, names: list[bytes]) -> list[bool]:
        """Whether each name is held."""
        with self._lock:
            return [n in self._index for n in names]

    def get(self, name: bytes) -> bytes | None:
        """The record of `name` (now the most recently used), or None."""
        with self._lock:
            self._index.touch(name)
            return self._records.get(name)

    def put(self, name: bytes, parent: bytes | None, record: bytes, spill: bool) -> tuple[bool, Spilled]:
        """Hold `record`; the leaves let go of to stay under capacity (records always, as they
        are already in memory)."""
        out: Spilled = []
        with self._lock:
            self._records[name] = record
            self._index.add(name, len(record), parent)
            while self._index.bytes > self.capacity_bytes:
                victim = self._index.victim()
                out.append((victim, self._index.parent(victim), self._records.pop(victim)))
                self._index.remove(victim)
        return True, out

    def delete(self, name: bytes) -> None:
        """Forget `name` (a bad record)."""
        with self._lock:
            self._index.remove(name)
            self._records.pop(name, None)

    def close(self) -> None:
        with self._lock:
            self._records.clear()
            self._index = PrefixLRU()
