"""--autoscale on a disaggregated server (serve.scaler_disagg.DisaggTarget), without ranks: the
driver's real routing state and admin calls (engine.driver.disagg_engines over
engine.disagg.routing) under decisions made by hand. A decode engine turned prefill is drained
first and switched once idle (its ranks told through its inbox), an add serves a drained engine,
and a healing job's new engine gets the threshold the autoscaler set."""

import collections
import queue
import threading
from types import SimpleNamespace

from atoll.engine.disagg.routing import Routing
from atoll.engine.driver.disagg_engines import EngineChanges
from atoll.parallel.layout import Layout
from atoll.serve.autoscale import Decision, Fleet
from atoll.serve.scaler_disagg import DisaggTarget

TP1 = Layout.parse("TP1")


class Driver(EngineChanges):
    """A DisaggEngine's routing state without its ranks (what EngineChanges reads): X prefill
    engines, then decode engines, one replica each, started with --disagg-min-prompt-tokens 4."""

    def __init__(self, prefill: int, decode: int):
        n = prefill + decode
        self.layouts, self.x = [TP1] * n, prefill
        self.routing = Routing(self.layouts, prefill)
        self._lock = threading.Lock()
        self._slots = [(e, 0) for e in range(n)]
        self._load, self._waiting, self.taken = [0] * n, [0] * n, [0] * n
        self._seen = [set() for _ in range(n)]
        self._dead, self._engine_stats, self.degraded = {}, {}, {}
        self._inboxes = [queue.Queue() for _ in range(n)]
        self.live = SimpleNamespace(name=lambda k: f"engine {k}")
        self.min_prompt_tokens, self.stats = 4, {"waiting": 0}
        self.remote_prompts = collections.deque()


def test_a_decode_engine_turns_prefill_once_idle_and_back():
    driver = Driver(1, 2)
    target = DisaggTarget(lambda: driver, print)
    assert target.fleet() == Fleet(prefill=1, decode=2, threshold=4, base_threshold=4, remote_prompts=())
    driver._load = [0, 0, 1]  # engine 2 runs one request
    assert target.act(Decision("role", "prefill", "TTFT short")) == (1, True)  # the least loaded decode engine
    driver._load = [0, 1, 1]  # a request still running on engine 1: it drains
    assert driver.routing.off == {1} and target.fleet() == Fleet(prefill=1, decode=1, threshold=4, base_threshold=4, remote_prompts=())
    assert target.act(Decision("role", "prefill", "again")) == (None, False)  # one turn at a time
    assert driver.routing.roles == ["prefill", "decode", "decode"] and driver._inboxes[1].empty()
    driver._load[1] = 0  # idle now: the next look switches it
    assert target.fleet() == Fleet(prefill=2, decode=1, threshold=4, base_threshold=4, remote_prompts=())
    assert driver.routing.roles == ["prefill", "prefill", "decode"] and not driver.routing.off
    assert driver._inboxes[1].get_nowait() == ("role", "prefill")
    assert target.act(Decision("role", "prefill", "TTFT short")) == (None, False)  # the last decode engine stays

    assert target.act(Decision("role", "decode", "TPOT short")) == (1, True)  # back: the last least loaded
    assert target.fleet() == Fleet(prefill=1, decode=2, threshold=4, base_threshold=4, remote_prompts=())
    assert driver._inboxes[1].get_nowait() == ("role", "decode")


def test_an_add_serves_a_drained_engine_in_the_role_asked():
    driver = Driver(1, 2)
    target = DisaggTarget(lambda: driver, print)
    assert target.act(Decision("add", "prefill", "TTFT short")) == (None, False)  # none free
    driver.drain_engine(2)  # an operator drained decode engine 2 (idle)
    assert target.fleet().free == 1
    assert target.act(Decision("add", "prefill", "TTFT short")) == (2, True)  # it turns prefill to serve
    assert driver.routing.roles == ["prefill", "decode", "prefill"] and not driver.routing.off
    assert target.fleet() == Fleet(prefill=2, decode=1, free=0, threshold=4, base_threshold=4, remote_prompts=())


def test_a_healing_disaggregated_jobs_new_engine_gets_the_threshold_the_autoscaler_set():
    live = [Driver(1, 1)]
    target = DisaggTarget(lambda: live[0], print)
    assert target.fleet() == Fleet(prefill=1, decode=1, threshold=4, base_threshold=4, remote_prompts=())
    assert target.act(Decision("threshold", "decode", "why", 8)) == (None, True) and live[0].min_prompt_tokens == 8
    assert target.act(Decision("add", "prefill", "why")) == (None, False)
    live[0] = Driver(1, 1)  # the job restarted after a failure: a new engine, at the flag's threshold
    assert target.fleet().threshold == 8 and live[0].min_prompt_tokens == 8
