"""Slow before dead: a replica whose steps become outliers against its peers' is drained before
it fails. No new request goes to it, its requests migrate with their tokens (serve.replicas),
and it is restarted under the RestartPolicy (serve.restarts).

EngineConfig.slow_step_ratio (off by default) and slow_step_window: a replica whose median
gap between step reports over its last `window` steps is `ratio` times the median of its live
peers' medians is an outlier. A late heartbeat (EngineConfig.heartbeat_timeout_s, the local
launcher's) and a stall (stall_timeout_s) fail the engine from inside; a GPU's critical Xid or
new uncorrected ECC errors drain it from outside (serve.gpu_health). Every time a
replica is taken out it is logged with its reason and counted in
atoll_router_replica_drains_total{replica, reason}.
"""

from __future__ import annotations

import statistics
import sys
import threading

from prometheus_client import Counter

from atoll.serve import gpu_health

WATCH_S = 0.25  # how often the watch compares the replicas' steps
PEER_STEPS = 3  # a peer's median counts once it has this many gaps


def outliers(gaps: dict[int, list[float]], ratio: float, window: int) -> dict[int, str]:
    """replica -> why it is an outlier, among the replicas whose step gaps are given: one with
    a full window whose median is `ratio` times the median of its peers' medians."""
    medians = {r: statistics.median(g) for r, g in gaps.items() if len(g) >= PEER_STEPS}
    out = {}
    for r, g in gaps.items():
        peers = [m for p, m in medians.items() if p != r]
        if len(g) < window or not peers:
            continue
        mine, theirs = statistics.median(g[-window:]), statistics.median(peers)
        if theirs > 0 and mine >= ratio * theirs:
            out[r] = (f"slow steps: median {mine * 1000:.0f} ms over its last {window} steps, "
                      f"{mine / theirs:.1f}x its peers' {theirs * 1000:.0f} ms (slow_step_ratio {ratio:g})")
    return out


def reason_of(line: str) -> str:
    """The metric's reason label for a replica taken out with this line."""
    if line.startswith("slow steps"):
        return "slow"
    if "no heartbeat" in line:
        return "heartbeat"
    if "--stall-timeout-s" in line:
        return "stall"
    if line.startswith("GPU "):
        return "gpu"
    return "failed"


def drains_counter(registry) -> Counter:
    return Counter("atoll_router_replica_drains", "replicas taken out of the router, by reason (slow: its steps "
                   "were outliers against its peers'; heartbeat: a rank's heartbeat was late; stall: no step "
                   "within --stall-timeout-s; gpu: NVML reported a critical Xid or new uncorrected ECC errors "
                   "(serve.gpu_health); failed: a rank died); each is restarted under the restart policy", ["replica", "reason"], registry=registry)


def note_down(replicas, replica: int, line: str) -> None:
    """Log and count a replica taken out (serve.replicas._mark_dead calls it once per outage)."""
    reason = reason_of(line)
    state = "is down" if reason == "failed" else "is drained"
    print(f"atoll: {replicas.name(replica)} {state} ({reason}): {line}", file=sys.stderr, flush=True)
    m = replicas.metrics
    if m is not None:
        m["up"].labels(str(replica)).set(0)
        m["drains"].labels(str(replica), reason).inc()


def drain(replicas, replica: int, line: str) -> None:
    """Take a live replica out: no new request goes to it, its requests migrate, it restarts."""
    engine = replicas.engines[replica]
    replicas._mark_dead(replica, line, engine)  # out of the router; its restart waits for its backoff
    engine._fail(line)  # its requests' sinks see an error and continue on a live replica


def watch(replicas, stop: threading.Event) -> None:
    """Compare the live replicas' steps every WATCH_S and drain the outliers (a thread)."""
    cfg = replicas.engines[0].spec.engine
    while not stop.wait(WATCH_S):
        with replicas._lock:
            live = {r: e for r, e in enumerate(replicas.engines) if r not in replicas._dead}
        gaps = {r: list(e.step_gaps) for r, e in live.items()}
        for r, line in outliers(gaps, cfg.slow_step_ratio, cfg.slow_step_window).items():
            if len(live) > 1:  # never the last one serving
                drain(replicas, r, line)
                live.pop(r)


def start_watches(replicas, stop: threading.Event) -> list[threading.Thread]:
    """The slow-step watch and the GPU health watch (serve.gpu_health), those that apply."""
    threads = [start_watch(replicas, stop),
               gpu_health.start_watch(replicas, stop, lambda r, line: drain(replicas, r, line))]
    return [t for t in threads if t is not None]


def start_watch(replicas, stop: threading.Event) -> threading.Thread | None:
    """The watch, where it applies: slow_step_ratio set and more than one replica."""
    cfg = getattr(replicas.engines[0], "spec", None)
    if cfg is None or cfg.engine.slow_step_ratio is None or len(replicas.engines) < 2:
        return None
    thread = threading.Thread(target=watch, args=(replicas, stop), daemon=True, name="atoll-slow-watch")
    thread.start()
    return thread
