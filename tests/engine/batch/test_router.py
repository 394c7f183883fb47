"""The replica router and the replica set, without processes: cache-aware routing by the
engines' own block names, least-loaded and balance fallbacks, round-robin over the live
replicas; a dead replica's requests retried before their first token and failed, naming it,
after; /health's degraded state and the error once every replica is dead."""

import time

import pytest

from atoll.engine.kv.blocks import BlockPool, block_hash, prefix_names
from atoll.engine.driver.online import EngineDead
from atoll.config.sampling import SamplingParams
from atoll.engine.batch.request import Request
from atoll.errors import InputError
from atoll.serve.replicas import Replicas
from atoll.serve.restarts import RestartPolicy, Restarts
from atoll.engine.batch.router import CacheAwareRouter, RoundRobinRouter, make_router

BS = 4


def router(n=3, capacity=100, imbalance=8):
    return CacheAwareRouter([capacity] * n, block_size=BS, imbalance=imbalance)


def test_prefix_names_are_the_pools_names():
    tokens = list(range(11))
    names = prefix_names(tokens, BS)
    assert len(names) == 2
    assert names[0] == block_hash(None, tokens[:4]) and names[1] == block_hash(names[0], tokens[4:8])
    pool = BlockPool(8, BS)
    table: list[int] = []
    pool.grow(table, 8)
    for block, name in zip(table, names):
        pool.name(block, name)
    assert pool.lookup(prefix_names(tokens + [99], BS)) == table


def test_cache_aware_sends_a_shared_prefix_where_it_went_and_new_ones_to_the_least_loaded():
    r = router()
    system_a, system_b = list(range(100, 116)), list(range(200, 216))
    first = r.choose(system_a + [1, 2], loads=[0, 0, 0], alive=[0, 1, 2])
    assert first.reason == "least_loaded" and first.replica == 0
    other = r.choose(system_b + [1, 2], loads=[1, 0, 0], alive=[0, 1, 2])
    assert other.reason == "least_loaded" and other.replica == 1
    again = r.choose(system_a + [7, 8, 9], loads=[1, 1, 0], alive=[0, 1, 2])
    assert again == type(again)(0, "prefix", 16)  # four shared blocks
    # equal loads: a new prefix goes to the replica whose cache holds least
    assert r.choose(list(range(300, 320)), loads=[0, 0, 0], alive=[0, 1, 2]).replica == 2
    # the block of the last token is never counted as a hit (the engine computes it)
    assert r.choose(system_a, loads=[1, 1, 0], alive=[0, 1, 2]).hit_tokens == 12


def test_cache_aware_balances_away_from_a_busy_replica_and_skips_the_dead():
    r = router(imbalance=2)
    prompt = list(range(40))
    assert r.choose(prompt, loads=[0, 0, 0], alive=[0, 1, 2]).replica == 0
    assert r.choose(prompt, loads=[1, 0, 0], alive=[0, 1, 2]).reason == "prefix"
    route = r.choose(prompt, loads=[2, 0, 1], alive=[0, 1, 2])
    assert (route.replica, route.reason) == (1, "balance")
    r.forget(0)
    assert r.choose(prompt, loads=[0, 1, 0], alive=[1, 2]).replica == 1  # 1 now holds it too


def test_the_cache_model_forgets_the_least_recently_used_beyond_the_capacity():
    r = router(n=2, capacity=2)
    a, b = list(range(9)), list(range(50, 59))
    r.choose(a, loads=[0, 0], alive=[0, 1])  # two blocks of a on replica 0
    r.choose(b, loads=[0, 5], alive=[0, 1])  # b's two push a out
    assert r.models[0].match(prefix_names(a, BS)) == 0 and r.models[0].match(prefix_names(b, BS)) == 2


def test_round_robin_cycles_over_the_live_replicas():
    r = RoundRobinRouter()
    picks = [r.choose([1], [0] * 3, [0, 1, 2]).replica for _ in range(4)]
    assert picks == [0, 1, 2, 0]
    assert [r.choose([1], [0] * 3, [0, 2]).replica for _ in range(3)] == [2, 0, 2]
    with pytest.raises(ValueError, match="cache_aware, round_robin"):
        make_router("random", capacities=[1], block_size=BS, imbalance=1)


class FakeEngine:
    """OnlineEngine's surface: requests are held until the test sends their events."""

    def __init__(self):
        self.sinks, self.requests, self.error, self.closed = {}, {}, None, False
        self.stats = {"running": 1, "num_blocks": 10}
        self.info = {"num_blocks": 10, "block_size": BS, "max_num_seqs": 4}

    def submit(self, request, sink):
        if self.error is not None:
            raise EngineDead(self.error)
        self.sinks[request.index], self.requests[request.index] = sink, request

    def abort(self, index):
        self.sinks.pop(index)("finish", {"finish_reason": "abort"})

    def die(self, line):
        self.error = line
        sinks, self.sinks = self.sinks, {}
        for sink in sinks.values():
            sink("error", line)

    def close(self, timeout_s=30.0):
        self.closed = True


def Req(index, ids):
    return Request(index, ids, SamplingParams(max_tokens=8))


def test_a_dead_replica_s_requests_go_on_elsewhere_with_their_tokens():
    engines = [FakeEngine(), FakeEngine()]
    reps = Replicas(engines, RoundRobinRouter())
    events: dict[int, list] = {}
    for i in range(4):  # round-robin: 0, 2 on replica 0; 1, 3 on replica 1
        reps.submit(Req(reps.new_id(), [i]), lambda kind, payload, i=i: events.setdefault(i, []).append((kind, payload)))
    engines[0].sinks[0]("token", (5, None))  # request 0 has streamed a token, request 2 has not
    engines[0].die("rank 0 on node0 failed: killed by SIGKILL")
    assert events[0] == [("token", (5, None))]  # no error: it goes on
    assert 2 not in events and set(engines[1].sinks) == {0, 1, 2, 3}  # sent again to replica 1
    assert engines[1].requests[0].generated == [5] and engines[1].requests[0].prompt_token_ids == [0]
    assert engines[1].requests[2].generated == []
    engines[1].sinks[0]("token", (6, None))
    engines[1].sinks[0]("finish", {"finish_reason": "length", "metrics": {}})
    assert events[0][1:] == [("token", (6, None)), ("finish", {"finish_reason": "length", "metrics": {"migrations": 1}})]
    assert reps.error is None and reps.degraded == {0: "rank 0 on node0 failed: killed by SIGKILL"}
    assert reps.stats == {"running": 1, "num_blocks": 10}  # the live replica's counters only
    engines[1].sinks[2]("finish", {"finish_reason": "length"})
    assert events[2] == [("finish", {"finish_reason": "length"})]
    reps.abort(3)
    assert events[3] == [("finish", {"finish_reason": "abort"})]
    reps.submit(Req(reps.new_id(), [9]), lambda *a: None)
    assert 4 in engines[1].sinks  # new work goes to the live one
    engines[1].die("rank 0 on node0 failed: exit code 1")
    assert events[1][-1] == ("error", "replica 1: rank 0 on node0 failed: exit code 1")  # none left to retry on
    assert reps.error.startswith("every replica failed: replica 0: ") and "replica 1: " in reps.error
    with pytest.raises(EngineDead, match="every replica failed"):
        reps.submit(Req(reps.new_id(), [1]), lambda *a: None)
    reps.close()
    assert all(e.closed for e in engines)


def test_a_dead_replica_comes_back_and_its_held_requests_go_on_there():
    made = []

    def start(k):
        made.append(FakeEngine())
        return made[-1]

    first = FakeEngine()
    engines = [first]
    reps = Replicas(engines, RoundRobinRouter(), start=start, policy=RestartPolicy(max_restarts=1, backoff_s=0))
    events: list = []
    reps.submit(Req(reps.new_id(), [7]), lambda kind, payload: events.append((kind, payload)))
    first.sinks[0]("token", (3, None))
    first.die("rank 0 on node0 failed: killed by SIGKILL")  # no other replica: held for the restart
    deadline = time.monotonic() + 10
    while reps.degraded and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not reps.degraded and reps.engines[0] is made[0] and first.closed
    assert made[0].requests[0].generated == [3] and events == [("token", (3, None))]
    made[0].die("rank 0 on node0 failed: exit code 1")  # a second failure: max_restarts 1 within the window
    assert events[-1] == ("error", "replica 0: rank 0 on node0 failed: exit code 1 (crash loop: 1 restarts "
                                   "within 600 s; it stays down)")
    assert "crash loop: 1 restarts within 600 s" in reps.degraded[0] and reps.error.startswith("every replica failed")
    reps.close()


def test_restart_policy_refuses_bad_values():
    with pytest.raises(InputError, match="--max-restarts -1 must be a whole number"):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(InputError, match="--restart-policy 'always'"):
        RestartPolicy("always")
    r = Restarts(RestartPolicy(max_restarts=3, backoff_s=1, max_backoff_s=3, window_s=60), 1)
    assert [r.next_backoff(0, now=t) for t in (0, 1, 2, 3)] == [1, 2, 3, None]  # doubling, capped, then none
    assert r.next_backoff(0, now=61.5) == 2  # the first two left the window: this is the second within it


def test_a_replica_found_dead_at_submit_is_skipped():
    engines = [FakeEngine(), FakeEngine()]
    engines[0].error = "rank 0 on node0 failed: killed by SIGKILL"
    reps = Replicas(engines, RoundRobinRouter())
    reps.submit(Req(reps.new_id(), [1]), lambda *a: None)
    assert 0 in engines[1].sinks and reps.degraded.keys() == {0}


def test_a_dense_model_s_dp_is_replicas_and_an_moe_model_keeps_it():
    from types import SimpleNamespace

    from atoll.cli.serve_replicas import check_replicas, take_replicas
    from atoll.errors import InputError, LaunchError

    dense, moe = SimpleNamespace(is_moe=False), SimpleNamespace(is_moe=True)
    args = SimpleNamespace(plan=None, data_parallel_size=None, layout="TP2DP2")
    assert take_replicas(args, dense) == 2 and args.layout == "TP2"
    args = SimpleNamespace(plan=None, data_parallel_size=3, layout=None)
    assert take_replicas(args, dense) == 3 and args.data_parallel_size is None
    args = SimpleNamespace(plan=None, data_parallel_size=2, layout=None)
    assert take_replicas(args, moe) == 1 and args.data_parallel_size == 2
    with pytest.raises(InputError, match="not both"):
        take_replicas(SimpleNamespace(plan=None, data_parallel_size=2, layout="DP2"), dense)
    with pytest.raises(LaunchError, match="one job serves one engine"):
        check_replicas(2, "torchrun")
    check_replicas(2, "ray")


def test_with_events_an_early_eviction_sends_the_prefix_elsewhere_and_tiers_count_half():
    system = list(range(100, 116))  # four blocks of 4
    names = prefix_names(system + [1], BS)
    evented = CacheAwareRouter([100, 100], block_size=BS, imbalance=8, events=True, tiers=[False, False])
    sent = make_router("sent_prefix", capacities=[100, 100], block_size=BS, imbalance=8)
    assert (evented.name, sent.name) == ("cache_aware", "sent_prefix")
    for r in (evented, sent):
        first = r.choose(system + [1], loads=[0, 0], alive=[0, 1])
        assert first.replica == 0
    # while the first request runs its prompt's blocks count as replica 0's, whatever the events say
    evented.observe(0, [(False, n) for n in names])
    assert evented.choose(system + [3], loads=[1, 0], alive=[0, 1]).reason == "prefix"
    evented.settle(0, first.names)
    evented.settle(0, first.names)
    # replica 0's engine computed the prefix, then let it go under load before the next request
    evented.observe(0, [(True, n) for n in names] + [(False, n) for n in names])
    late = evented.choose(system + [2], loads=[1, 0], alive=[0, 1])
    assert (late.replica, late.reason) == (1, "least_loaded")  # the engines' record: nowhere
    assert sent.choose(system + [2], loads=[1, 0], alive=[0, 1]).reason == "prefix"  # its own model: still there
    # a replica whose tiers keep what its pool evicts: half a hit a block
    tiered = CacheAwareRouter([100, 100], block_size=BS, imbalance=8, events=True, tiers=[True, False])
    assert not tiered.models[0].pending
    tiered.observe(0, [(True, n) for n in names] + [(False, n) for n in names])
    route = tiered.choose(system + [2], loads=[1, 0], alive=[0, 1])
    assert (route.replica, route.reason, route.hit_tokens) == (0, "prefix", 8)  # 4 blocks x 4 x 0.5
    # a named event brings a block back to the pool's count
    tiered.observe(1, [(True, names[0])])
    assert tiered.models[1].match(names) == 1
