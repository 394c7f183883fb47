"""The local-disk tier: one file per block under a directory atoll owns, so a block the host
tier lets go of is still a read away, and a restarted server comes back warm.

A file is written under a temporary name in the same directory and renamed over its place
(os.replace), so a reader sees a whole record or none; a crash mid-write leaves only a
temporary file, removed at the next open. No fsync: a record torn by a power cut fails its
checks (record.py) and reads as a miss. Files fan out over 256 folders by the name's last
byte. The directory must be empty or atoll's own (a marker file says so): a cache that deletes
files to stay under its capacity must never be pointed at someone's data. A private directory
is one engine rank's alone: it holds an exclusive lock on it (flock) while open, so a second
engine pointed at it is refused in one line instead of evicting the first one's files.

A failed write (a full disk: ENOSPC, EDQUOT, EFBIG) makes the tier let go of a record's worth
of blocks and retry once; a second failure turns its writes off with one warning, and the
server goes on with the tiers it has (reads still work). The same class serves a shared
directory (shared.py): there other processes write too, so `has` and `get` look at the files
rather than this process's index, and leftover temporary files are not this process's to remove.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import threading
from pathlib import Path

from atoll.engine.kv.tiers.host import Spilled
from atoll.engine.kv.tiers.index import Indexed, PrefixLRU
from atoll.errors import ConfigError

MARKER = ".atoll-kv-tier"
LOCK = ".atoll-kv-tier.lock"
TEMP = ".tmp-"
log = logging.getLogger(__name__)


def claim(directory: Path) -> None:
    """Create `directory` if missing and mark it atoll's; ConfigError if it holds anything else."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        foreign = sorted(e.name for e in os.scandir(directory) if not _ours(e))
    except OSError as e:
        raise ConfigError(f"KV tier directory {directory}: {e.strerror or e}") from None
    if foreign:
        named = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ConfigError(f"KV tier directory {directory} holds {named}, not atoll's: give an empty "
                          f"directory or one an atoll KV tier made")
    if not (directory / MARKER).exists():
        try:
            _write(directory, directory / MARKER, b"atoll KV cache tier: one record per block (engine/kv/tiers); "
                                                  b"delete the directory to clear it\n")
        except OSError as e:
            raise ConfigError(f"KV tier directory {directory}: {e.strerror or e}") from None


def _ours(entry: os.DirEntry) -> bool:
    """The marker, a temporary file, or a fan-out folder (two hex digits)."""
    if entry.name in (MARKER, LOCK) or entry.name.startswith(TEMP):
        return True
    return len(entry.name) == 2 and entry.is_dir() and all(c in "0123456789abcdef" for c in entry.name)


_serial = itertools.count()


def _write(folder: Path, path: Path, data: bytes) -> None:
    """`data` at `path`, whole or not at all: a temporary name in `folder`, then a rename."""
    tmp = folder / f"{TEMP}{path.name}-{os.getpid()}-{threading.get_ident()}-{next(_serial)}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class DiskTier(Indexed):
    """Block records as files under `directory`, at most `capacity_bytes` of them (None: no
    limit, for a shared directory whose owner sizes it)."""

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int | None, name: str = "disk",
                 shared: bool = False):
        self.directory = Path(directory).absolute()
        self.capacity_bytes, self.name, self.shared = capacity_bytes, name, shared
        self.enabled = True
        self._index = PrefixLRU()
        self._lock = threading.Lock()  # the index: the writer thread puts while the engine thread gets
        claim(self.directory)
        self._held = None if shared else _hold(self.directory)
        self._reindex()

    def path(self, name: bytes) -> Path:
        return self.directory / name[-1:].hex() / name.hex()

    def _reindex(self) -> None:
        """Hold the block files already here, oldest first (a restart comes back warm); their
        parents are not known, so among them the oldest go first. Then trim to the capacity."""
        found = []
        for folder in os.scandir(self.directory):
            if not (folder.is_dir() and _ours(folder)):
                continue
            for entry in os.scandir(folder.path):
                if entry.name.startswith(TEMP):
                    if not self.shared:  # a crashed write's; in a shared directory maybe another's, live
                        _unlink(entry.path)
                    continue
                try:
                    name, stat = bytes.fromhex(entry.name), entry.stat()
                except (ValueError, OSError):
                    continue  # not a block file: left alone
                found.append((stat.st_mtime_ns, name, stat.st_size))
        for _, name, size in sorted(found):
            self._index.add(name, size)
        self._trim(0, spill=False)

    def has(self, names: list[bytes]) -> list[bool]:
        """Whether each name is held (in a shared directory: whether its file exists)."""
        if self.shared:
            return [self.path(n).exists() for n in names]
        with self._lock:
            return [n in self._index for n in names]

    def get(self, name: bytes) -> bytes | None:
        """The record of `name` (now the most recently used), or None."""
        with self._lock:
            if not self.shared and name not in self._index:
                return None
            self._index.touch(name)
        try:
            return self.path(name).read_bytes()
        except OSError:  # gone (evicted meanwhile, or by another process) or unreadable: a miss
            with self._lock:
                self._index.remove(name)
            return None

    def put(self, name: bytes, parent: bytes | None, record: bytes, spill: bool) -> tuple[bool, Spilled]:
        """Write `record` (skipped when its file is here already); the leaves let go of to stay
        under capacity, or to make room after a failed write."""
        here = self.path(name).exists() if self.shared else None  # another process may have written it
        with self._lock:
            refresh = here or (here is None and name in self._index)
            if refresh:
                self._index.add(name, len(record), parent or self._index.parent(name))
        if refresh:
            return True, self._trim(0, spill)
        out: Spilled = []
        for attempt in (1, 2):
            try:
                folder = self.path(name).parent
                folder.mkdir(exist_ok=True)
                _write(folder, self.path(name), record)
                break
            except OSError as e:
                if attempt == 1:
                    out += self._trim(len(record), spill)
                    continue
                self.enabled = False
                log.warning("KV tier %s (%s): a write failed twice (%s); its writes are off, serving goes on",
                            self.name, self.directory, e.strerror or e)
                return False, out
        with self._lock:
            self._index.add(name, len(record), parent)
        return True, out + self._trim(0, spill)

    def _trim(self, room: int, spill: bool) -> Spilled:
        """Let go of leaves until `room` bytes fit under the capacity (with no capacity: at
        least `room` bytes); their records read first when `spill`."""
        out: Spilled = []
        with self._lock:
            limit = self.capacity_bytes if self.capacity_bytes is not None else self._index.bytes
            freed = 0
            while self._index.bytes and (self._index.bytes + room > limit or freed < room):
                victim = self._index.victim()
                out.append((victim, self._index.parent(victim), None))
                freed += self._index.remove(victim)
        for i, (victim, parent, _) in enumerate(out):
            path = self.path(victim)
            if spill:
                try:
                    out[i] = (victim, parent, path.read_bytes())
                except OSError:
                    pass
            _unlink(path)
        return [o for o in out if o[2] is not None or not spill]

    def delete(self, name: bytes) -> None:
        """Remove `name`'s file (a bad record)."""
        with self._lock:
            self._index.remove(name)
        _unlink(self.path(name))

    def close(self) -> None:
        if self._held is not None:  # the lock goes with the descriptor
            os.close(self._held)
            self._held = None


def _hold(directory: Path) -> int:
    """An exclusive lock on a private directory, held while the tier is open (its descriptor);
    ConfigError naming the holder when another process has it."""
    path = directory / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise ConfigError(f"KV tier directory {directory} is in use by {holder}: give each engine its own "
                          f"--kv-disk-dir (replicas and disaggregated engines take subdirectories of one)") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"atoll process {os.getpid()}".encode())
    return fd


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
