"""GPU health (issue 37, "slow before dead" on GPUs, serve/gpu_health.py): the verdict on NVML's
counters, the mapping of a replica's cuda:N ranks to NVML's GPUs, the watch's decisions over a
scripted counter source (this machine has no GPU: NVML itself is not exercised here), and the
one line when NVML cannot be read."""

import threading
from types import SimpleNamespace

import pytest

from atoll.config.engine import EngineConfig
from atoll.errors import InputError
from atoll.serve import drain, gpu_health
from atoll.serve.gpu_health import Counts, nvml_indices, parse_xids, verdict

XIDS = parse_xids(EngineConfig().gpu_health_xids)


def test_a_listed_xid_is_unfit_and_another_is_not():
    assert verdict(3, Counts(xids=[13]), xids=XIDS, ecc_limit=0) is None  # 13: an application's fault
    line = verdict(3, Counts(xids=[13, 79]), xids=XIDS, ecc_limit=0)
    assert line.startswith("GPU 3 reported Xid 79") and drain.reason_of(line) == "gpu"


def test_uncorrected_ecc_errors_past_the_limit_are_unfit():
    assert verdict(0, Counts(ecc_start=2, ecc_now=2), xids=(), ecc_limit=0) is None
    assert "added 1 uncorrected ECC" in verdict(0, Counts(ecc_start=2, ecc_now=3), xids=(), ecc_limit=0)
    assert verdict(0, Counts(ecc_start=2, ecc_now=4), xids=(), ecc_limit=2) is None
    assert verdict(0, Counts(ecc_start=2, ecc_now=9), xids=(), ecc_limit=None) is None
    assert verdict(0, Counts(ecc_start=None, ecc_now=None), xids=(), ecc_limit=0) is None  # no ECC on it


def test_cuda_devices_map_to_nvml_indices_through_cuda_visible_devices():
    uuids = {"GPU-aa": 5, "GPU-bb": 1}
    assert nvml_indices(["cuda:0", "cuda:1"], None, uuids.get) == [0, 1]
    assert nvml_indices(["cuda:0", "cuda:1"], "", uuids.get) == [0, 1]
    assert nvml_indices(["cuda:0", "cuda:1"], "6, 2", uuids.get) == [6, 2]
    assert nvml_indices(["cuda:1"], "GPU-aa,GPU-bb", uuids.get) == [1]
    assert nvml_indices(["cpu", "cpu"], "0,1", uuids.get) == []


class Counters:
    """NVML's readings as a script: ECC counts by GPU, Xid events in turn."""

    def __init__(self, ecc: dict, events: list):
        self.ecc_counts, self.events, self.reads = dict(ecc), list(events), 0

    def ecc(self, gpu):
        self.reads += 1
        return self.ecc_counts[gpu]

    def xid(self, wait_ms):
        return self.events.pop(0) if self.events else None


def _replicas():
    return SimpleNamespace(_lock=threading.RLock(), _dead={}, _restarting=set())


def _watch(counters, gpus, *, cfg=None, until=lambda taken: len(taken) >= 1, ticks=50):
    replicas, stop, taken = _replicas(), threading.Event(), []
    cfg = cfg or EngineConfig()
    left = [ticks]

    def xid(wait_ms):  # the watch's clock: each wait is one tick; stop once seen enough, or after `ticks`
        left[0] -= 1
        if until(taken) or left[0] <= 0:
            stop.set()
        return Counters.xid(counters, wait_ms)

    counters.xid = xid

    def take_out(r, line):
        taken.append((r, line))
        replicas._dead[r] = line

    gpu_health.watch(replicas, counters, gpus, stop, cfg, take_out)
    return taken


def test_the_watch_drains_the_replica_whose_gpu_reports_a_critical_xid():
    counters = Counters({0: 0, 1: 0, 2: 0, 3: 0}, [None, (3, 13), (2, 48)])
    taken = _watch(counters, {0: [0, 1], 1: [2, 3]})
    assert [r for r, _ in taken] == [1] and "GPU 2 reported Xid 48" in taken[0][1]


def test_the_watch_drains_on_new_uncorrected_ecc_errors_and_not_on_old_ones():
    counters = Counters({0: 7, 1: 0}, [])  # GPU 0 had 7 before serving began: not counted
    gpus = {0: [0], 1: [1]}

    def until(taken):
        if counters.reads > 6:
            counters.ecc_counts[1] = 1  # then GPU 1 adds one
        return len(taken) >= 1

    taken = _watch(counters, gpus, until=until)
    assert [r for r, _ in taken] == [1] and "GPU 1 added 1 uncorrected ECC" in taken[0][1]


def test_nothing_is_drained_when_the_counters_stay_and_the_thresholds_are_off():
    assert _watch(Counters({0: 0}, [None, (0, 13)]), {0: [0]}, ticks=5) == []
    off = EngineConfig(gpu_health_xids="", gpu_health_ecc_limit=None)
    assert gpu_health.start_watch(SimpleNamespace(engines=[SimpleNamespace(spec=SimpleNamespace(engine=off))]),
                                  threading.Event(), None) is None


def _engines(devices):
    spec = SimpleNamespace(engine=EngineConfig())
    return SimpleNamespace(engines=[SimpleNamespace(spec=spec, job=SimpleNamespace(devices=devices))])


def test_cpu_replicas_start_no_watch_and_gpus_without_nvml_say_so_in_one_line(capsys, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_health.start_watch(_engines(["cpu"]), threading.Event(), None) is None
    assert capsys.readouterr().err == ""
    # a replica on cuda:0 here, where no NVML library (or no nvidia-ml-py) exists: one line, no watch
    assert gpu_health.start_watch(_engines(["cuda:0"]), threading.Event(), None) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "NVML's ECC and Xid counters are not read" in err[0]


@pytest.mark.parametrize("xids", ["48;79", "x", "48,-1"])
def test_bad_xid_lists_are_refused_in_one_line(xids):
    with pytest.raises(InputError, match="gpu_health_xids"):
        EngineConfig(gpu_health_xids=xids)


def test_a_negative_ecc_limit_is_refused():
    with pytest.raises(InputError, match="gpu_health_ecc_limit"):
        EngineConfig(gpu_health_ecc_limit=-1)
