"""The KV cache's lower tiers (engine/kv/tiers): the record and each way it goes bad, the
host tier's child-before-parent eviction spilling to the disk tier, the disk tier's directory
rules, restart, bad files, capacity and a real failed write (a file-size limit), and a shared
directory read by a second chain as another replica would. Redis: test_tiers_redis.py."""

import json
import os
import subprocess
import sys
import threading

import pytest

from atoll.engine.kv.blocks import prefix_names
from atoll.engine.kv.tiers.chain import TierChain
from atoll.engine.kv.tiers.disk import LOCK, MARKER, DiskTier
from atoll.engine.kv.tiers.host import HostTier
from atoll.engine.kv.tiers.record import HEADER, BadRecord, namespace, pack, unpack
from atoll.engine.kv.tiers.shared import SharedTier
from atoll.errors import ConfigError

SLICE = dict(model="tiny-llama@3f2a", dtype="bfloat16", kv_dtype="fp8_e4m3", layout="TP2PP2", tp_rank=0,
             tp_size=2, pp_stage=1, layers=[12, 24], block_size=16)
NS = namespace(**SLICE)
OTHER = namespace(**dict(SLICE, tp_rank=1))  # the same tokens on the other TP rank: other bytes
PAYLOAD = 1000
RECORD = HEADER.size + PAYLOAD


def chain_of(n: int, seed: int = 0) -> list[bytes]:
    """n block names chained as the pool names them."""
    return prefix_names([seed * 1000 + t for t in range(16 * n)], 16)


def payload(key: bytes) -> bytes:
    return (key * (PAYLOAD // len(key) + 1))[:PAYLOAD]


def offload_chain(chain: TierChain, keys: list[bytes]) -> None:
    for i, k in enumerate(keys):
        chain.offload(k, keys[i - 1] if i else None, payload(k))
    assert chain.flush(5)


def block_files(directory) -> dict[str, int]:
    return {f: os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(directory) for f in fs if f not in (MARKER, LOCK)}


def test_record_round_trip_and_namespace():
    key = chain_of(1)[0]
    assert unpack(NS, key, pack(NS, key, b"kv bytes")) == b"kv bytes"
    assert unpack(NS, key, pack(NS, key, b"")) == b""
    assert namespace(**SLICE) == namespace(**dict(reversed(SLICE.items())))  # order-free
    assert len({NS, OTHER, namespace(**dict(SLICE, kv_dtype="int8")), namespace(**dict(SLICE, block_size=32))}) == 4


@pytest.mark.parametrize("reason, spoil", [
    ("truncated", lambda r: r[:-1]),
    ("truncated", lambda r: r[:HEADER.size - 1]),
    ("torn", lambda r: r + b"\0"),
    ("torn", lambda r: b"XKV1" + r[4:]),
    ("checksum", lambda r: r[:-1] + bytes([r[-1] ^ 1])),
    ("foreign", lambda r: pack(OTHER, chain_of(1)[0], payload(chain_of(1)[0]))),
    ("key", lambda r: pack(NS, chain_of(1, seed=9)[0], payload(chain_of(1)[0]))),
])
def test_each_bad_record_says_why(reason, spoil):
    key = chain_of(1)[0]
    with pytest.raises(BadRecord) as bad:
        unpack(NS, key, spoil(pack(NS, key, payload(key))))
    assert bad.value.reason == reason


def test_host_evicts_children_before_parents_into_the_disk(tmp_path):
    a, b, c = chain_of(3)
    others = chain_of(3, seed=1)
    host = HostTier(3 * RECORD)
    with TierChain([host, DiskTier(tmp_path / "kv", 100 * RECORD)], NS) as chain:
        offload_chain(chain, [a, b, c])
        went = []
        for k in others:  # unrelated single blocks, each newer than the chain
            chain.offload(k, None, payload(k))
            assert chain.flush(5)
            went += [x for x in (a, b, c) if x not in went and not host.has([NS + x])[0]]
            assert len(went) == len(others[:others.index(k) + 1])  # one at a time
        assert went == [c, b, a]  # the chain's leaf first, its root last
        disk = chain.tiers[1]
        assert disk.has([NS + x for x in (a, b, c)]) == [True] * 3
        assert chain.stats()["host"]["evictions"] == 3
        assert chain.lookup([a, b, c]) == 3
        assert chain.fetch([a, b, c]) == [payload(x) for x in (a, b, c)]
        stats = chain.stats()
        assert stats["disk"]["hits"] == 3 and stats["host"]["misses"] == 3
        assert stats["disk"]["bytes_out"] == 3 * RECORD and stats["disk"]["fetch_seconds"] > 0
        assert chain.flush(5)  # promoted back into the host, which lets go of its oldest leaves
        assert host.has([NS + x for x in (a, b, c)]) == [True] * 3


def test_lookup_counts_leading_blocks_and_fetch_stops_at_a_miss(tmp_path):
    keys = chain_of(4)
    with TierChain([HostTier(100 * RECORD)], NS) as chain:
        offload_chain(chain, keys[:2] + keys[3:])  # keys[2] never offloaded
        assert chain.lookup(keys) == 2 and chain.lookup(keys[3:]) == 1 and chain.lookup([]) == 0
        assert chain.fetch(keys) == [payload(k) for k in keys[:2]]
        with TierChain([HostTier(100 * RECORD)], OTHER) as other:  # another slice's names are its own
            assert other.lookup(keys) == 0


def test_offloads_past_the_pending_bound_are_dropped_and_counted():
    with TierChain([HostTier(100 * RECORD)], NS, max_pending_bytes=0) as chain:
        offload_chain(chain, chain_of(3))
        assert chain.stats()["writes_dropped"] == 3 and chain.lookup(chain_of(3)) == 0
    with TierChain([], NS) as empty:
        empty.offload(chain_of(1)[0], None, b"x")
        assert empty.lookup(chain_of(1)) == 0 and empty.fetch(chain_of(1)) == []


def test_writer_thread_is_named_and_stops_on_close():
    chain = TierChain([HostTier(RECORD)], NS)
    writer = next(t for t in threading.enumerate() if t.name == "atoll-kv-tiers")
    assert writer.daemon
    chain.close(timeout=5)
    assert not chain._thread.is_alive()


def test_fetches_while_the_writer_works_see_whole_blocks(tmp_path):
    """The engine thread fetches while the writer stores, spills and promotes: every block it
    gets back is whole and its own."""
    keys = chain_of(60)
    with TierChain([HostTier(8 * RECORD), DiskTier(tmp_path / "kv", 30 * RECORD)], NS) as chain:
        for i, k in enumerate(keys):
            chain.offload(k, keys[i - 1] if i else None, payload(k))
            if i % 5 == 4:
                got = chain.fetch(keys[:i])
                assert got == [payload(k) for k in keys[:len(got)]]
        assert chain.flush(5)
        got = chain.fetch(keys)
        assert got == [payload(k) for k in keys[:len(got)]]
        assert sum(chain.stats()["checksum_misses"].values()) == 0


def test_disk_refuses_a_directory_holding_other_files(tmp_path):
    mine = tmp_path / "data"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    before = sorted(os.listdir(mine))
    with pytest.raises(ConfigError, match=f"{mine} holds notes.txt, not atoll's"):
        DiskTier(mine, 10 * RECORD)
    assert sorted(os.listdir(mine)) == before  # no marker, nothing
    with pytest.raises(ConfigError, match="KV tier directory"):
        DiskTier(mine / "notes.txt", 10 * RECORD)  # a file, not a directory


def test_a_private_directory_is_one_engines_until_it_closes(tmp_path):
    """Two engines evicting each other's files would both lose blocks: the second is refused,
    by name, until the first closes (a restart then opens it)."""
    first = DiskTier(tmp_path / "kv", 10 * RECORD)
    with pytest.raises(ConfigError, match=f"{tmp_path / 'kv'} is in use by atoll process {os.getpid()}: give each"):
        DiskTier(tmp_path / "kv", 10 * RECORD)
    first.close()
    DiskTier(tmp_path / "kv", 10 * RECORD).close()
    shared = [DiskTier(tmp_path / "both", None, shared=True) for _ in range(2)]  # a shared one is everyone's
    assert all(t.enabled for t in shared)


def test_disk_comes_back_warm_after_a_restart(tmp_path):
    keys = chain_of(3)
    with TierChain([DiskTier(tmp_path / "kv", 100 * RECORD)], NS) as chain:
        offload_chain(chain, keys)
    assert (tmp_path / "kv" / MARKER).exists()
    again = DiskTier(tmp_path / "kv", 100 * RECORD)
    assert again.blocks == 3 and again.bytes == 3 * RECORD
    with TierChain([again], NS) as chain:
        assert chain.lookup(keys) == 3
        assert chain.fetch(keys) == [payload(k) for k in keys]


@pytest.mark.parametrize("reason, spoil", [
    ("checksum", lambda path, key: path.write_bytes(path.read_bytes()[:-1] + b"?")),
    ("truncated", lambda path, key: path.write_bytes(path.read_bytes()[:RECORD // 2])),
    ("foreign", lambda path, key: path.write_bytes(pack(OTHER, key, payload(key)))),
])
def test_a_bad_disk_file_is_a_counted_miss_and_is_deleted(tmp_path, reason, spoil):
    keys = chain_of(3)
    disk = DiskTier(tmp_path / "kv", 100 * RECORD)
    with TierChain([disk], NS) as chain:
        offload_chain(chain, keys)
        spoil(disk.path(NS + keys[1]), keys[1])
        assert chain.fetch(keys) == [payload(keys[0])]  # the walk stops at the bad one
        stats = chain.stats()
        assert stats["checksum_misses"][reason] == 1 and sum(stats["checksum_misses"].values()) == 1
        assert stats["disk"]["hits"] == 1 and stats["disk"]["misses"] == 1
        assert not disk.path(NS + keys[1]).exists() and chain.lookup(keys) == 1


def test_disk_stays_under_its_capacity_and_inside_its_directory(tmp_path):
    before = sorted(os.listdir(tmp_path))
    disk = DiskTier(tmp_path / "kv", 5 * RECORD)
    keys = chain_of(20)
    with TierChain([HostTier(2 * RECORD), disk], NS) as chain:
        offload_chain(chain, keys)
        files = block_files(tmp_path / "kv")
        assert sum(files.values()) <= 5 * RECORD and disk.bytes == sum(files.values()) and disk.blocks == 5
        stats = chain.stats()
        assert stats["disk"]["evictions"] == 13 and stats["writes_dropped"] == 0
        held = [k for k in keys if disk.has([NS + k])[0]]
        assert len(held) == 5 and all(unpack(NS, k, disk.get(NS + k)) == payload(k) for k in held)
    assert sorted(os.listdir(tmp_path)) == sorted(before + ["kv"])
    assert not [f for f in os.listdir(tmp_path / "kv") if f.startswith(".tmp-")]


def shared_by_two_replicas(url: str) -> list[bytes]:
    """Replica one writes a chain to the shared store `url` (its host tier holds nothing), replica
    two finds, fetches and promotes it, and another namespace sees none of it; the keys."""
    keys = chain_of(4)
    with TierChain([HostTier(0), SharedTier.open(url)], NS) as one, \
            TierChain([HostTier(100 * RECORD), SharedTier.open(url)], NS) as two:
        offload_chain(one, keys)  # the host holds nothing: every block goes on to the shared tier
        assert one.stats()["shared"]["bytes_in"] == 4 * RECORD
        assert two.lookup(keys) == 4
        assert two.fetch(keys) == [payload(k) for k in keys]
        assert two.stats()["shared"]["hits"] == 4
        assert two.flush(5) and two.stats()["host"]["blocks"] == 4  # promoted
    with TierChain([SharedTier.open(url)], OTHER) as other:
        assert other.lookup(keys) == 0
    return keys


def test_a_shared_directory_serves_a_second_replica(tmp_path):
    shared_by_two_replicas(f"file://{tmp_path / 'shared'}")


def test_shared_urls_it_cannot_use_are_one_line_errors(tmp_path):
    for url in ("s3://bucket/kv", "file://host/kv", "redis://localhost:notaport"):
        with pytest.raises(ConfigError, match="KV shared tier"):
            SharedTier.open(url)
    with pytest.raises(ConfigError, match="maxmemory"):
        SharedTier.open("redis://127.0.0.1:1", capacity_bytes=1 << 20)


FULL_DISK = """
import json, resource, signal, sys
from atoll.engine.kv.tiers.chain import TierChain
from atoll.engine.kv.tiers.disk import DiskTier
from atoll.engine.kv.tiers.host import HostTier
from atoll.engine.kv.tiers.record import namespace
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
ns = namespace(model="m")
keys = [bytes([i]) * 16 for i in range(8)]
with TierChain([HostTier(2 * 4160), DiskTier(sys.argv[1], None)], ns) as chain:
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    for k in keys:
        chain.offload(k, None, k * 256)
    assert chain.flush(5)
    print(json.dumps({"stats": chain.stats(), "fetched": len(chain.fetch(keys[-2:])), "held": chain.lookup(keys)}))
"""


def test_a_failed_disk_write_turns_the_disk_off_with_one_warning(tmp_path):
    """A real failed write: a file-size limit of 1 KiB under 4 KiB records (EFBIG, as ENOSPC
    would be), in a child process since the limit is the process's."""
    run = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path / "kv")], capture_output=True,
                         text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    warnings = run.stderr.strip().splitlines()
    assert len(warnings) == 1 and "writes are off" in warnings[0], run.stderr
    assert out["stats"]["disk"]["enabled"] is False and out["stats"]["host"]["enabled"] is True
    assert out["stats"]["writes_dropped"] == 6 and out["fetched"] == 2 and out["held"] == 0
    assert block_files(tmp_path / "kv") == {}
