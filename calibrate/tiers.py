"""`atoll calibrate`'s KV cache tier figures (topologies/tiers.py), measured through the engine's
own tiers (engine/kv/tiers) with blocks the size of SmolLM2-135M's: 16 tokens x 30 layers x k and
v x 3 kv heads x 64 dims x 2 bytes = 368,640 bytes.

- host: write = a block packed into its record (header and checksum, record.py) and put in a
  HostTier, as the tiers' writer does; read = got back, checked and unpacked (TierChain.fetch),
  then joined into one buffer as the rank copies blocks in (engine/rank/kv_tiers.write_blocks).
  GB/s of block payload, one thread (a rank's reader or writer).
- disk: a DiskTier in a temporary directory (under --kv-disk-dir when given: the disk the tier
  will use), one file per block written under a temporary name and renamed into place
  (os.replace, as disk.py does). Write: the puts, then each file synced to the disk (fsync), so
  the figure is the disk's and not the page cache's. Read: every file's pages dropped from the
  page cache first (posix_fadvise DONTNEED, where the OS has it), then the gets.

Short by design: a fraction of a second each (--quick: fewer blocks and repeats).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from atoll.calibrate.timing import timed
from atoll.engine.kv.tiers.disk import DiskTier
from atoll.engine.kv.tiers.host import HostTier
from atoll.engine.kv.tiers.record import pack, unpack

BLOCK_BYTES = 16 * 30 * 2 * 3 * 64 * 2  # SmolLM2-135M: tokens x layers x (k, v) x kv heads x head dim x bf16
NAMESPACE = b"atoll-calibrate!"  # 16 bytes: record.pack's namespace


def _blocks(n: int, size: int) -> list[tuple[bytes, bytes]]:
    """n (name, payload) pairs: 16-byte names, payloads of `size` distinct bytes."""
    return [(i.to_bytes(16, "big"), os.urandom(size)) for i in range(n)]


def host_gb_s(*, quick: bool = False, block_bytes: int = BLOCK_BYTES) -> dict:
    """{"read_gb_s", "write_gb_s"} of the host tier for blocks of `block_bytes`."""
    blocks = _blocks(12 if quick else 32, block_bytes)
    total = len(blocks) * block_bytes
    tier = HostTier(total * 2)

    def write():
        for name, payload in blocks:
            tier.put(name, None, pack(NAMESPACE, name, payload), False)

    def read():
        b"".join(unpack(NAMESPACE, name, tier.get(name)) for name, _ in blocks)

    write_s = timed(write, 0.05 if quick else 0.2)
    read_s = timed(read, 0.05 if quick else 0.2)
    tier.close()
    return {"read_gb_s": round(total / read_s / 1e9, 3), "write_gb_s": round(total / write_s / 1e9, 3)}


def _drop_cache(paths) -> bool:
    """Drop the files' pages from the page cache (after fsync they are clean); False where the OS
    cannot (the reads then come from memory)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def _fsync(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def disk_gb_s(*, quick: bool = False, where: str | None = None, block_bytes: int = BLOCK_BYTES) -> dict:
    """{"read_gb_s", "write_gb_s"} of a disk tier in a temporary directory under `where` (default
    the system's), and whether the reads were cold ("cold": False where the page cache stayed)."""
    blocks = _blocks(12 if quick else 32, block_bytes)
    total = len(blocks) * block_bytes
    records = [(name, pack(NAMESPACE, name, payload)) for name, payload in blocks]
    writes, reads, cold = [], [], True
    with tempfile.TemporaryDirectory(prefix="atoll-calibrate-kv-", dir=where) as top:
        for rep in range(1 if quick else 2):
            tier = DiskTier(Path(top) / f"r{rep}", None)
            paths = [tier.path(name) for name, _ in records]
            t = time.perf_counter()
            for name, record in records:
                tier.put(name, None, record, False)
            _fsync(paths)
            writes.append(time.perf_counter() - t)
            cold = _drop_cache(paths) and cold
            t = time.perf_counter()
            for name, _ in records:
                unpack(NAMESPACE, name, tier.get(name))
            reads.append(time.perf_counter() - t)
            tier.close()
    return {"read_gb_s": round(total / min(reads) / 1e9, 3), "write_gb_s": round(total / min(writes) / 1e9, 3),
            "cold": cold}


def measure_tiers(*, quick: bool = False, where: str | None = None) -> tuple[dict, str]:
    """(the topology's kv_tiers mapping, how it was measured)."""
    host = host_gb_s(quick=quick)
    disk = disk_gb_s(quick=quick, where=where)
    cold = disk.pop("cold")
    how = (f"KV tiers: {BLOCK_BYTES:,}-byte blocks through the engine's HostTier and a DiskTier in "
           f"{where or tempfile.gettempdir()} (writes synced, reads {'cold' if cold else 'from the page cache'})")
    return {"host": host, "disk": disk}, how
