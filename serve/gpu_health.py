"""Slow before dead, on GPUs: NVML's counters. A replica whose GPU reports a critical Xid
(NVML's critical Xid events: a double-bit ECC error, a row remap, an NVLink error, a GPU off
the bus, ...) or adds uncorrected ECC errors while it serves is drained as a slow one is
(serve.drain): no new request goes to it, its requests migrate with their tokens, and it is
restarted under the restart policy.

EngineConfig.gpu_health_xids (the Xids that drain, "" for none) and gpu_health_ecc_limit (the
uncorrected ECC errors a GPU may add, None for no limit) are the thresholds. The watch runs
where a replica's ranks run on this machine's GPUs (the local launcher): NVML numbers GPUs by
PCI bus, so CUDA_VISIBLE_DEVICES is read to find them (its indices, or GPU-... UUIDs), and
CUDA's own order is taken to be NVML's, as on a node of one GPU kind. It needs the
nvidia-ml-py package (`pip install 'atoll[gpu]'`); without it, or without NVML, one line says
the counters are not read and serving goes on.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass, field

WAIT_MS = 1000  # how long the watch waits for an Xid event before it reads the ECC counts again


def parse_xids(text: str | None) -> tuple[int, ...]:
    """'48,79' -> (48, 79); '' or None -> (): the Xids that drain (EngineConfig validates it)."""
    if not text:
        return ()
    return tuple(int(x) for x in str(text).replace(" ", "").split(",") if x)


@dataclass
class Counts:
    """What the watch saw of one GPU: the uncorrected ECC count at the start (or after its
    replica's last drain) and the Xids reported since."""
    ecc_start: int | None = None
    ecc_now: int | None = None
    xids: list[int] = field(default_factory=list)


def verdict(gpu: int, counts: Counts, *, xids: tuple[int, ...], ecc_limit: int | None) -> str | None:
    """Why GPU `gpu` (NVML's index) is unfit to serve on, or None."""
    bad = [x for x in counts.xids if x in xids]
    if bad:
        return f"GPU {gpu} reported Xid {bad[0]} (gpu_health_xids {','.join(map(str, xids))})"
    if ecc_limit is not None and counts.ecc_start is not None and counts.ecc_now is not None:
        added = counts.ecc_now - counts.ecc_start
        if added > ecc_limit:
            return (f"GPU {gpu} added {added} uncorrected ECC error(s) while serving "
                    f"(gpu_health_ecc_limit {ecc_limit})")
    return None


def nvml_indices(devices: list[str], visible: str | None, index_of_uuid) -> list[int]:
    """NVML's index of each cuda:N device of a replica's ranks (cpu ranks have none)."""
    shown = [v.strip() for v in visible.split(",")] if visible not in (None, "") else None
    out = []
    for d in devices:
        if not str(d).startswith("cuda"):
            continue
        n = int(str(d).partition(":")[2] or 0)
        entry = shown[n] if shown is not None else str(n)
        out.append(int(entry) if entry.isdigit() else index_of_uuid(entry))
    return out


class Nvml:
    """NVML's counters of some GPUs (nvidia-ml-py's pynvml): the uncorrected ECC count, and the
    critical Xid events of every registered GPU."""

    def __init__(self, gpus: list[int]):
        import pynvml  # lazy: the optional atoll[gpu]

        self.nv = pynvml
        pynvml.nvmlInit()
        self.handles = {g: pynvml.nvmlDeviceGetHandleByIndex(g) for g in gpus}
        self.events = pynvml.nvmlEventSetCreate()
        self.no_xids: list[int] = []
        for g, h in self.handles.items():
            try:
                pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, self.events)
            except pynvml.NVMLError_NotSupported:
                self.no_xids.append(g)

    def ecc(self, gpu: int) -> int | None:
        nv = self.nv
        try:
            return int(nv.nvmlDeviceGetTotalEccErrors(self.handles[gpu], nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                      nv.NVML_VOLATILE_ECC))
        except nv.NVMLError_NotSupported:  # a GPU without ECC
            return None

    def xid(self, wait_ms: int) -> tuple[int, int] | None:
        """(GPU, Xid) of the next critical Xid event within wait_ms, or None."""
        nv = self.nv
        try:
            data = nv.nvmlEventSetWait_v2(self.events, wait_ms)
        except nv.NVMLError_Timeout:
            return None
        return int(nv.nvmlDeviceGetIndex(data.device)), int(data.eventData)

    def close(self) -> None:
        self.nv.nvmlEventSetFree(self.events)
        self.nv.nvmlShutdown()


def gpus_of(replicas) -> dict[int, list[int]]:
    """replica -> NVML indices of its ranks' GPUs (local ranks on CUDA only)."""
    out = {}
    for r, engine in enumerate(replicas.engines):
        devices = getattr(getattr(engine, "job", None), "devices", None) or []
        gpus = nvml_indices(devices, os.environ.get("CUDA_VISIBLE_DEVICES"), _uuid_index)
        if gpus:
            out[r] = gpus
    return out


def _uuid_index(uuid: str) -> int:
    import pynvml

    return int(pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(uuid)))


def watch(replicas, nvml, gpus: dict[int, list[int]], stop: threading.Event, cfg, take_out) -> None:
    """Read the counters until `stop`; take_out(replica, line) for a replica whose GPU is unfit
    (serve.drain.drain), then count that GPU from where it stands."""
    xids, limit = parse_xids(cfg.gpu_health_xids), cfg.gpu_health_ecc_limit
    counts = {g: Counts(ecc_start=nvml.ecc(g)) for gs in gpus.values() for g in gs}
    while not stop.is_set():
        event = nvml.xid(WAIT_MS)
        if event is not None and event[0] in counts:
            counts[event[0]].xids.append(event[1])
        with replicas._lock:
            live = [r for r in gpus if r not in replicas._dead and r not in replicas._restarting]
        for r in live:
            for g in gpus[r]:
                c = counts[g]
                c.ecc_now = nvml.ecc(g)
                line = verdict(g, c, xids=xids, ecc_limit=limit)
                if line is not None:
                    take_out(r, line)
                    for other in gpus[r]:  # the restarted replica starts clean
                        counts[other] = Counts(ecc_start=nvml.ecc(other))
                    break


def start_watch(replicas, stop: threading.Event, take_out) -> threading.Thread | None:
    """The watch, where it applies: a replica on this machine's GPUs and a threshold set."""
    cfg = getattr(getattr(replicas.engines[0], "spec", None), "engine", None)
    if cfg is None or (not parse_xids(cfg.gpu_health_xids) and cfg.gpu_health_ecc_limit is None):
        return None
    try:
        gpus = gpus_of(replicas)
    except Exception as e:  # noqa: BLE001 - NVML missing: a UUID in CUDA_VISIBLE_DEVICES cannot be looked up
        print(f"atoll: GPU health: NVML's ECC and Xid counters are not read ({e})", file=sys.stderr, flush=True)
        return None
    if not gpus:
        return None
    try:
        nvml = Nvml(sorted({g for gs in gpus.values() for g in gs}))
    except Exception as e:  # noqa: BLE001 - no nvidia-ml-py, or no NVML library: serving goes on
        print(f"atoll: GPU health: NVML's ECC and Xid counters are not read ({type(e).__name__}: {e}; "
              f"pip install nvidia-ml-py)", file=sys.stderr, flush=True)
        return None
    if nvml.no_xids:
        print(f"atoll: GPU health: GPU(s) {nvml.no_xids} give no Xid events; their ECC counts are read",
              file=sys.stderr, flush=True)

    def run():
        try:
            watch(replicas, nvml, gpus, stop, cfg, take_out)
        finally:
            nvml.close()

    thread = threading.Thread(target=run, daemon=True, name="atoll-gpu-health")
    thread.start()
    return thread
