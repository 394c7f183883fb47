"""The disaggregated driver's routing table (engine.disagg.routing), without processes: a
drained engine takes nothing new, the last decode engine is never drained, a drained prefill
engine reads as full (so with none serving every prompt is prefilled on its decode engine), and
role changes are refused in one line unless the engine is drained, idle and of the role's layout."""

import math

import pytest

from atoll.engine.disagg.decision import choose_path
from atoll.engine.disagg.routing import EngineStateError, Routing
from atoll.parallel.layout import Layout

TP1, TP2 = Layout.parse("TP1"), Layout.parse("TP2")


def one_p_two_d() -> Routing:
    return Routing([TP1, TP1, TP1], prefill_replicas=1)


def test_a_drained_decode_engine_takes_no_new_request_and_serves_again():
    r = one_p_two_d()
    slots = [(0, 0), (1, 0), (2, 0)]  # every engine's one replica: engine 0 prefills
    assert r.least_loaded([0, 3, 0], slots) == 2  # the least loaded
    assert r.drain(2) is True and r.drain(2) is False
    assert r.least_loaded([0, 3, 0], slots) == 1  # engine 2 drained: engine 1 takes it, though busier
    assert r.serving("decode") == [1]
    assert r.serve(2) is True and r.serve(2) is False
    assert r.least_loaded([0, 3, 0], slots) == 2


def test_the_last_decode_engine_is_never_drained():
    r = one_p_two_d()
    r.drain(1)
    with pytest.raises(EngineStateError, match="engine 2 is the last decode engine serving") as e:
        r.drain(2)
    assert e.value.status == 409 and "\n" not in str(e.value)
    r2 = one_p_two_d()  # a dead decode engine does not count as serving
    with pytest.raises(EngineStateError, match="last decode engine"):
        r2.drain(1, dead={2})


def test_a_drained_prefill_engine_reads_as_full():
    r = Routing([TP1, TP1, TP1], prefill_replicas=2)
    assert choose_path(50, r.prefill_waiting([0, 5]), min_prompt_tokens=10, max_prefill_queue=None).prefill == 0
    r.drain(0)
    assert r.prefill_waiting([0, 5]) == [math.inf, 5]
    path = choose_path(50, r.prefill_waiting([0, 5]), min_prompt_tokens=10, max_prefill_queue=None)
    assert (path.remote, path.prefill) == (True, 1)
    r.drain(1)  # the last prefill engine may go: its decode engines prefill every prompt
    path = choose_path(50, r.prefill_waiting([0, 5]), min_prompt_tokens=10, max_prefill_queue=None)
    assert path.remote is False


def test_role_changes_are_refused_in_one_line():
    r = Routing([TP2, TP1, TP1], prefill_replicas=1)
    for k, role, busy, status, line in [
        (5, "prefill", 0, 404, "engine 5 does not exist"),
        (1, "encode", 0, 400, "role='encode': choose one of prefill, decode"),
        (1, "prefill", 0, 409, "engine 1 is serving: drain it"),
    ]:
        with pytest.raises(EngineStateError, match=line) as e:
            r.check_role(k, role, busy)
        assert e.value.status == status and "\n" not in str(e.value)
    r.drain(2)
    with pytest.raises(EngineStateError, match=r"engine 2 is draining \(1 request\(s\) running\)"):
        r.check_role(2, "prefill", 1)
    with pytest.raises(EngineStateError, match="engine 2 runs TP1 but the prefill engines run TP2"):
        r.check_role(2, "prefill", 0)
    assert r.check_role(2, "decode", 0) is False  # its role already


def test_a_drained_engine_of_the_roles_layout_changes_role():
    r = one_p_two_d()
    slots = [(0, 0), (1, 0), (2, 0)]
    r.drain(2)
    assert r.switch(2, "prefill", 0) is True and r.roles == ["prefill", "decode", "prefill"]
    assert r.switch(2, "prefill", 0) is False
    r.serve(2)  # 2P1D: it prefills, and takes no request to decode
    assert r.prefill_waiting([4, 0, 1]) == [4, math.inf, 1]
    assert r.least_loaded([0, 9, 0], slots) == 1
    r.drain(0)  # back: engine 0 drained, to decode
    assert r.switch(0, "decode", 0) is True
    r.serve(0)
    assert r.least_loaded([0, 9, 0], slots) == 0 and r.prefill_waiting([4, 0, 1]) == [math.inf, math.inf, 1]


def test_a_colocated_decode_engine_prefills_every_prompt_and_loses_it_with_its_role():
    r = Routing([TP1, TP1, TP1, TP1], prefill_replicas=1, colocated=2)  # 1P1D plus 2 colocated replicas
    assert r.colocated == {2, 3}
    long = dict(min_prompt_tokens=10, max_prefill_queue=None)
    assert choose_path(5000, [0], **long).remote is True  # engine 1's prompt goes to the prefill engine
    path = choose_path(5000, [0], **long, colocated=True)  # engine 2's or 3's never does
    assert (path.remote, path.reason) == (False, "colocated")
    r.drain(3)
    assert r.switch(3, "prefill", busy=0) is True
    assert r.colocated == {2}
    r.switch(3, "decode", busy=0)
    assert r.colocated == {2}  # back in the decode role it is a plain decode engine


def test_colocated_replicas_are_refused_in_one_line():
    from atoll.config.engine import EngineConfig
    from atoll.errors import InputError

    for kwargs, line in [
        (dict(colocated_replicas=1), "--colocated-replicas needs --prefill and --decode"),
        (dict(prefill="TP1", decode="TP1", decode_replicas=2, colocated_replicas=2),
         "--colocated-replicas 2 must leave a decode engine"),
        (dict(prefill="TP1", decode="TP1", colocated_replicas=-1), "colocated_replicas=-1 must be a whole number"),
    ]:
        with pytest.raises(InputError, match=line) as e:
            EngineConfig(**kwargs)
        assert "\n" not in str(e.value)
    assert EngineConfig(prefill="TP1", decode="TP1", decode_replicas=3, colocated_replicas=2).colocated_replicas == 2
