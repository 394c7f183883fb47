"""The shared KV tier on a real redis-server (started here on a free port, killed by pid): two
chains share its blocks as two replicas would, and a server killed mid-run turns the tier off
with one warning while the local tiers go on serving."""

import logging
import time

import pytest
from redis_server import free_port, server  # noqa: F401  (the redis-server fixture)

from atoll.engine.kv.tiers.chain import TierChain
from atoll.engine.kv.tiers.disk import DiskTier
from atoll.engine.kv.tiers.host import HostTier
from atoll.engine.kv.tiers.record import unpack
from atoll.engine.kv.tiers.shared import SharedTier

from test_tiers import NS, RECORD, chain_of, offload_chain, payload, shared_by_two_replicas

redis = pytest.importorskip("redis", reason="the redis package (pip install 'atoll[kv]')")


def test_two_replicas_share_blocks_through_redis(server):
    url, _ = server
    keys = shared_by_two_replicas(url)
    stored = redis.Redis.from_url(url).keys("*")
    assert sorted(stored) == sorted(b"atoll:kv:" + (NS + k).hex().encode() for k in keys)


def test_a_bad_record_in_redis_is_a_counted_miss_and_is_deleted(server):
    url, _ = server
    keys = chain_of(2)
    with TierChain([SharedTier.open(url)], NS) as chain:
        offload_chain(chain, keys)
        client = redis.Redis.from_url(url)
        name = b"atoll:kv:" + (NS + keys[1]).hex().encode()
        client.set(name, client.get(name)[:-3])
        assert chain.fetch(keys) == [payload(keys[0])]
        assert chain.stats()["checksum_misses"]["truncated"] == 1 and not client.exists(name)


def test_redis_killed_mid_run_turns_the_tier_off_with_one_warning(server, tmp_path, caplog):
    url, proc = server
    keys = chain_of(6)
    tiers = [HostTier(2 * RECORD), DiskTier(tmp_path / "kv", 2 * RECORD), SharedTier.open(url)]
    with TierChain(tiers, NS) as chain:
        offload_chain(chain, keys)  # 2 in the host, 2 on disk, 2 in Redis
        assert chain.stats()["shared"]["bytes_in"] == 2 * RECORD and chain.lookup(keys) == 6
        proc.kill()
        proc.wait(timeout=10)
        with caplog.at_level(logging.WARNING):
            start = time.monotonic()
            here = [tiers[0].has([NS + k])[0] or tiers[1].has([NS + k])[0] for k in keys]
            assert sum(here) == 4 and chain.lookup(keys) == (here + [False]).index(False)
            more = chain_of(6, seed=2)
            offload_chain(chain, more)  # the local tiers take them; what falls off the disk is dropped
            local = [(t, k) for k in more for t in tiers[:2] if t.has([NS + k])[0]]
            assert len(local) == 4 and all(unpack(NS, k, t.get(NS + k)) == payload(k) for t, k in local)
            ask = [local[0][1]] + keys
            got = chain.fetch(ask)  # its first block read before any promotion could move it
            assert got and got == [payload(k) for k in ask[:len(got)]]
            assert time.monotonic() - start < 5
        stats = chain.stats()
    shared = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(shared) == 1 and url in shared[0].getMessage(), [r.getMessage() for r in shared]
    assert stats["shared"]["enabled"] is False and stats["host"]["enabled"] and stats["disk"]["enabled"]
    assert stats["writes_dropped"] >= 6  # what fell off the disk with nowhere below to go


def test_an_unreachable_redis_at_start_is_one_warning(caplog):
    url = f"redis://127.0.0.1:{free_port()}"
    with caplog.at_level(logging.WARNING), TierChain([HostTier(RECORD), SharedTier.open(url)], NS) as chain:
        keys = chain_of(3)
        offload_chain(chain, keys)
        assert chain.lookup(keys) == 0 and chain.lookup(keys[2:]) == 1
        assert chain.fetch(keys[2:]) == [payload(keys[2])]
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
