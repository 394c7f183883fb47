"""Slow before dead without processes: serve.drain's outlier rule, its config fields' errors, a
fault naming one replica, the heartbeat threshold, and Replicas draining an outlier (its request
continues on the peer with its tokens, the replica restarts, the drain is counted by reason)."""

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from atoll.config.engine import EngineConfig
from atoll.config.faults import FaultInjection
from atoll.engine.batch.router import RoundRobinRouter
from atoll.engine.rank.run_spec import RunSpec
from atoll.errors import InputError, RankFailure
from atoll.launch import local
from atoll.serve import drain
from atoll.serve.replicas import Replicas
from atoll.serve.restarts import RestartPolicy


def test_an_outlier_is_a_full_window_ratio_times_its_peers_median():
    fast, slow = [0.1] * 4, [0.25, 0.5, 0.5, 0.6]
    got = drain.outliers({0: fast, 1: slow, 2: [0.12] * 3}, ratio=3.0, window=4)
    assert list(got) == [1] and "median 500 ms over its last 4 steps, 4.5x its peers' 110 ms" in got[1]
    assert drain.outliers({0: fast, 1: slow}, ratio=6.0, window=4) == {}  # under the ratio
    assert drain.outliers({0: fast, 1: slow[:3]}, ratio=3.0, window=4) == {}  # its window not full yet
    assert drain.outliers({1: slow}, ratio=3.0, window=4) == {}  # no peer to compare with
    assert drain.outliers({0: [0.1, 0.1], 1: slow}, ratio=3.0, window=4) == {}  # the peer has too few steps


def test_reasons():
    assert drain.reason_of("slow steps: median 500 ms") == "slow"
    assert drain.reason_of("rank 0 on h failed: stopped responding: no heartbeat for 2 s") == "heartbeat"
    assert drain.reason_of("the ranks sent no step for 2 s while 3 requests ran (--stall-timeout-s): x") == "stall"
    assert drain.reason_of("rank 1 on h failed: killed by SIGKILL") == "failed"


@pytest.mark.parametrize("changes, line", [
    (dict(slow_step_ratio=1.0), "slow_step_ratio=1.0 must be a number above 1"),
    (dict(slow_step_ratio="x"), "slow_step_ratio='x' must be a number above 1"),
    (dict(slow_step_window=0), "slow_step_window=0 must be a whole number of at least 1"),
    (dict(heartbeat_timeout_s=0), "heartbeat_timeout_s=0 must be a positive number"),
    (dict(fault_injection="delay:rank=0:ms=5:replica=-1"), "replica='-1' must be a whole number of at least 0"),
])
def test_bad_thresholds_are_one_line_naming_the_field(changes, line):
    with pytest.raises(InputError, match=line.replace("(", r"\(")):
        EngineConfig(**changes)


def test_defaults():
    c = EngineConfig()
    assert (c.slow_step_ratio, c.slow_step_window, c.heartbeat_timeout_s) == (None, 16, 10.0)


def test_a_fault_naming_a_replica_strikes_only_there(tmp_path):
    spec = RunSpec.of(str(tmp_path), "TP1", max_model_len=64,
                      fault_injection="delay:rank=0:ms=300:step=2:replica=1,kill:rank=0:step=9")
    assert str(spec.for_engine("replica0").engine.fault_injection) == "kill:rank=0:step=9"
    assert str(spec.for_engine("replica1").engine.fault_injection) == \
        "delay:rank=0:ms=300:step=2:replica=1,kill:rank=0:step=9"
    only = FaultInjection.parse("drop:rank=0:replica=1")
    assert only.for_replica(0) is None and only.for_replica(1) == only


class _Proc:
    exitcode = None


def test_the_heartbeat_threshold_is_the_jobs():
    now = 1000.0
    beats = [now - 3.0]  # 3 s late
    local._check_heartbeats([_Proc()], beats, {}, now, spawned=0.0, stall_s=10.0)  # within 10 s
    with pytest.raises(RankFailure, match="no heartbeat for 3 s"):
        local._check_heartbeats([_Proc()], beats, {}, now, spawned=0.0, stall_s=2.0)


@dataclass
class _Request:
    index: int
    prompt_token_ids: list
    fork_of: int | None = None
    generated: list = field(default_factory=list)


class _Engine:
    """An OnlineEngine's face to Replicas: submit, _fail, step_gaps, close."""

    def __init__(self, cfg, gaps=()):
        self.spec = SimpleNamespace(engine=cfg)
        self.step_gaps = deque(gaps)
        self.error, self.info, self.stats, self.closed = None, {}, {}, False
        self.sinks: dict = {}
        self.got = threading.Event()

    def submit(self, request, sink):
        self.sinks[request.index] = (request, sink)
        self.got.set()

    def abort(self, index):
        pass

    def _fail(self, line):
        self.error = line
        sinks, self.sinks = self.sinks, {}
        for _, sink in sinks.values():
            sink("error", line)

    def close(self, timeout_s=30.0):
        self.closed = True


def test_replicas_drain_an_outlier_its_request_migrates_and_it_restarts(capsys):
    cfg = EngineConfig(slow_step_ratio=3.0, slow_step_window=4)
    fast, slow = _Engine(cfg, [0.1] * 4), _Engine(cfg, [0.5] * 3)  # slow: one step short of its window
    started = []

    def start(k):
        started.append(_Engine(cfg))
        return started[-1]

    replicas = Replicas([fast, slow], RoundRobinRouter(), start=start, policy=RestartPolicy(backoff_s=0.0))
    replicas.attach_metrics(CollectorRegistry())
    seen = []
    try:
        for i in range(2):
            replicas.submit(_Request(i, [3, 4, 5]), lambda kind, payload: seen.append((kind, payload)))
        assert len(fast.sinks) == len(slow.sinks) == 1  # round robin: one each
        on_slow = next(iter(slow.sinks))
        slow.sinks[on_slow][1]("token", (42, None, None))
        fast.got.clear()
        time.sleep(3 * drain.WATCH_S)
        assert not fast.got.is_set() and not replicas.degraded  # not a full window: no drain yet
        slow.step_gaps.append(0.6)
        assert fast.got.wait(5), capsys.readouterr().err
        moved, _ = fast.sinks[on_slow]
        assert moved.generated == [42]  # it continues with the token its client saw
        deadline = time.monotonic() + 5
        while (not started or replicas.degraded) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert replicas.engines[1] is started[0] and not replicas.degraded and slow.closed
        assert all(kind == "token" for kind, _ in seen)  # no error reached the client
        m = replicas.metrics
        assert m["drains"].labels("1", "slow")._value.get() == 1
        assert m["drains"].labels("0", "slow")._value.get() == 0
        assert m["restarts"].labels("1")._value.get() == 1
        assert "replica 1 is drained (slow): slow steps: median" in capsys.readouterr().err
    finally:
        replicas.close()
