"""Run one Ray actor per rank across a Ray cluster and collect results.

Ranks are grouped by node (launch.ray_cluster, launch.ray_placement): with a plan's placement, one group per
planned node in the plan's order, each pinned to its Ray node, and each rank on the GPU the
plan names; without one, consecutive ranks fill the nodes in whole TP groups (`tp_size`), or
in chunks of `ranks_per_node` when given. Each group gets its own placement group with
STRICT_PACK, so a group (and so every TP group inside it) lands on one node. One placement
group for all ranks cannot say this: STRICT_PACK would need one node for everything, PACK may
split a TP group when a node is short, SPREAD splits it on purpose. Each group's reservation
is atomic; if they are not all ready in time, all are released and the error names what the
cluster has.

Devices (launch.device): with device "cuda", or "auto" when the cluster has a GPU per rank,
each rank's actor reserves one GPU (bundles {"CPU": cpus_per_rank, "GPU": 1}); the driver
reserves nothing and may sit on a node without GPUs (nothing is pinned to its node). Ray is
told not to narrow CUDA_VISIBLE_DEVICES, so an actor sees every GPU of its node, and NCCL can
use peer access (NVLink) between the ranks of a node, which it cannot when each rank sees only
its own GPU; the actor computes on the GPU Ray assigned it (`gpu_index`), so two jobs sharing a
node stay apart. Rank 0's actor picks the rendezvous address (its node IP and a free port);
every actor pins gloo/NCCL to the interface holding its own node IP, and names its node by
Ray's node id (launch.net.NODE_VAR), so the ranks' islands and nodes are Ray's nodes.

As with run_local, the first rank that raises or whose actor dies ends the job within
seconds: every actor is killed and RankFailure names the rank, its node and the cause.

RayJob is a started job that lasts (the living engine's ranks: engine/rank/loop.py),
watched by its check() while the driver talks to rank 0 through RayChannels (Ray queues);
run_ray is one RayJob run to its end.
"""

from __future__ import annotations

import re
import sys
import threading
import time

from atoll.errors import LaunchError, RankFailure
from atoll.launch.device import check_requested
from atoll.launch.ray_actor import NOSET_CUDA_VISIBLE_DEVICES, _RankActor, gpu_index
from atoll.launch.ray_cluster import check_groups, connect, gpus_per_rank, node_names, rank_groups, reserve
from atoll.launch.ray_placement import match_gpus
from atoll.parallel.placement import check_job_placement

__all__ = ["RayChannel", "RayJob", "channel", "gpu_index", "run_ray"]

_POLL_S = 0.2
_GRACE_S = 2.0  # after a rank raises, how long to look for a dead actor, the likelier root cause


def _import_ray():
    try:
        import ray
    except ImportError:
        raise LaunchError("the Ray launcher needs Ray: pip install 'atoll[ray]'") from None
    return ray


def _death_cause(err) -> str:
    """One line from Ray's several-paragraph ActorDiedError text."""
    text = " ".join(str(err).split())
    pid = re.search(r"pid: (\d+)", text)
    who = f"actor (pid {pid.group(1)})" if pid else "actor"
    if "creation task" in text:
        return f"{who} could not start: {text.split('creation task')[-1].strip(' .:')[:200]}"
    why = re.search(r"The actor is dead because (.*?)\.", text)
    detail = re.search(r"Worker exit detail: (.*?)(?: Some common causes|$)", text)
    parts = [f"{who} died"] + ([why.group(1)] if why else []) + ([detail.group(1).strip()] if detail else [])
    return ": ".join(parts[:2]) + (f" ({parts[2]})" if len(parts) > 2 else "")


def run_ray(fn, world_size: int, *args, timeout_s: float | None = None, **kwargs) -> list:
    """Run fn(rank, world_size, *args, **kwargs) in one Ray actor per rank; return their values
    (RayJob's keywords: address, device, placement, tp_size, ...). Raises RankFailure naming
    the first rank that raised or died, after killing every actor."""
    start = time.monotonic()
    job = RayJob(fn, world_size, *args, timeout_s=timeout_s, **kwargs)
    try:
        left = None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - start))
        return job.wait(left, _total_s=timeout_s)
    finally:
        job.stop()


class RayChannel:
    """A queue between the driver and a Ray job's ranks (ray.util.queue.Queue, whose Empty is
    a queue.Empty), made on first use, so Ray is first connected by the job that gets it
    among fn's arguments; that job's stop() ends it. Its actor holds no CPU: a cluster whose
    CPUs the ranks hold still places it."""

    _lock = threading.Lock()

    def __init__(self):
        self._queue = None

    def _q(self):
        with RayChannel._lock:
            if self._queue is None:
                ray = _import_ray()
                if not ray.is_initialized():
                    raise RuntimeError("a RayChannel is used once its RayJob has connected Ray")
                from ray.util.queue import Queue

                self._queue = Queue(actor_options={"num_cpus": 0})
            return self._queue

    def put(self, item, block: bool = True, timeout: float | None = None) -> None:
        self._q().put(item, block, timeout)

    def get(self, block: bool = True, timeout: float | None = None):
        return self._q().get(block, timeout)

    def get_nowait(self):
        return self._q().get(block=False)

    def close(self) -> None:
        queue, self._queue = self._queue, None
        if queue is not None:
            try:
                queue.shutdown(force=True)
            except Exception:  # noqa: BLE001 - Ray is already gone
                pass

    def __getstate__(self):  # into an actor: the queue itself (its actor handle)
        return {"_queue": self._q()}


def channel() -> RayChannel:
    """A queue the driver and a Ray job's ranks share: give it to RayJob among fn's arguments."""
    return RayChannel()


class RayJob:
    """One Ray actor per rank running fn(rank, world_size, *args, **kwargs), started at once
    (placement groups reserved, actors made and placed, the rendezvous address chosen, every
    rank's fn launched). `check()` raises RankFailure for the first rank that raised or whose
    actor died, without waiting; `wait()` collects every rank's value; `stop()` kills the
    actors, releases the placement groups and the channels among fn's arguments, and shuts Ray
    down if this job started it.

    address: a Ray cluster ("host:port", "ray://host:port", "auto"); None starts Ray on this
    machine only, listening on 127.0.0.1. If Ray is already initialised it is used as is.
    device: "cuda" (one GPU per rank), "auto" (one GPU per rank when the cluster has that many,
    CUDA only if every rank's torch sees its GPU) or "cpu" (no GPU reserved).
    placement: a plan's rank -> (node, GPU) (parallel.placement.Placement, or any object with
    node_of(rank)); where Ray's GPUs differ from it, one warning line, or LaunchError when
    strict_placement. tp_size: without a placement, each TP group's ranks share a node.
    timeout_s bounds the start (the actors' start and rank 0's rendezvous address).
    """

    def __init__(self, fn, world_size: int, *args, address: str | None = None, device: str = "cpu",
                 timeout_s: float | None = None, placement=None, ranks_per_node: int | None = None,
                 tp_size: int = 1, strict_placement: bool = False, cpus_per_rank: float = 1,
                 ready_timeout_s: float = 60.0, **kwargs):
        check_requested(device)
        self.world_size = world_size  # as LocalJob's: its ranks, given-up ones included
        ray = self._ray = _import_ray()
        self._channels = [a for a in (*args, *kwargs.values()) if isinstance(a, RayChannel)]
        self._pgs, self._actors, self._stopped = [], [], False
        self._started = connect(ray, address, world_size)
        try:
            self._launch(fn, world_size, args, kwargs, device, timeout_s, placement, ranks_per_node, tp_size,
                         strict_placement, cpus_per_rank, ready_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _launch(self, fn, world_size, args, kwargs, device, timeout_s, placement, ranks_per_node, tp_size,
                strict_placement, cpus_per_rank, ready_timeout_s) -> None:
        ray = self._ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpus = gpus_per_rank(ray, device, world_size)
        requested = device if gpus else "cpu"  # auto without a GPU each: CPU ranks
        bundle = {"CPU": cpus_per_rank, **({"GPU": gpus} if gpus else {})}
        groups, targets = rank_groups(ray, world_size, placement, ranks_per_node, tp_size, bundle)
        check_groups(ray, groups, bundle)
        self._pgs = pgs = reserve(ray, groups, bundle, ready_timeout_s, targets)
        names = node_names(ray)
        actor_cls = ray.remote(_RankActor)
        # each actor sees its node's GPUs; launch.device picks Ray's assignment among them
        runtime_env = {"env_vars": {NOSET_CUDA_VISIBLE_DEVICES: "1"}} if gpus else None
        made: dict[tuple[int, int], object] = {}  # (group, bundle index) -> actor
        for k, (pg, g) in enumerate(zip(pgs, groups)):
            for i in range(len(g)):
                made[k, i] = actor_cls.options(
                    num_cpus=cpus_per_rank, num_gpus=gpus, max_restarts=0, runtime_env=runtime_env,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=i)).remote()
        self._actors = list(made.values())
        self.node_of = node_of = {}  # rank -> its node's name
        for k, (pg, g) in enumerate(zip(pgs, groups)):
            bundle_nodes = ray.util.placement_group_table(pg)["bundles_to_node_id"]
            for r in g:
                node_of[r] = names.get(bundle_nodes.get(g.index(r)), bundle_nodes.get(g.index(r)))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        slot = {r: (k, g.index(r)) for k, g in enumerate(groups) for r in g}  # rank -> (group, bundle)
        if targets is not None:
            slot = _follow_plan(ray, placement, groups, targets, made, bool(gpus), strict_placement,
                                node_of, deadline)
        self._ranked = ranked = [made[slot[r]] for r in range(world_size)]
        addr, port = _first(ray, ranked[0].rendezvous.remote(), node_of, deadline)
        self._refs = {a.run.remote(fn, r, world_size, addr, port, requested, slot[r][1], args, kwargs): r
                      for r, a in enumerate(ranked)}
        self._pending = list(self._refs)
        self.values: dict[int, object] = {}
        self._failure = None  # (rank, cause, traceback) of the first rank that raised
        self._failed_at = 0.0
        self.lost: set[int] = set()  # ranks given up on (give_up): no longer checked or waited for

    def check(self, wait_s: float = 0.0) -> None:
        """Take the values of the ranks that ended (waiting up to wait_s for one) and raise
        RankFailure for a dead actor at once, or for the first rank that raised once every
        rank ended or _GRACE_S passed (a dead actor is the likelier root cause)."""
        ray = self._ray
        if self._pending:
            ready, self._pending = ray.wait(self._pending, num_returns=1, timeout=wait_s)
            if ready and self._pending:  # every other one that is ready too
                more, self._pending = ray.wait(self._pending, num_returns=len(self._pending), timeout=0)
                ready += more
            for ref in ready:
                rank = self._refs[ref]
                if rank in self.lost:
                    continue
                try:
                    msg = ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                    raise _ray_failure(ray, e, rank, self.node_of) from None  # a dead actor: the root cause
                if msg[0] == "ok":
                    self.values[rank] = msg[1]
                elif self._failure is None:
                    self._failure, self._failed_at = (rank, msg[1], msg[2]), time.monotonic()
        failure = self._failure
        if failure is not None and (not self._pending or time.monotonic() - self._failed_at > _GRACE_S):
            raise RankFailure(failure[0], failure[1], node=self.node_of.get(failure[0])) \
                from _RemoteTraceback(failure[2])

    def give_up(self, ranks) -> None:
        """Kill these ranks' actors (the rest of the job goes on without them: a disaggregated
        job's dead engine) and stop checking or waiting for them."""
        ranks = [r for r in ranks if r not in self.lost]
        self.lost.update(ranks)
        self._pending = [ref for ref in self._pending if self._refs[ref] not in self.lost]
        if self._failure is not None and self._failure[0] in self.lost:
            self._failure = None
        for r in ranks:
            try:
                self._ray.kill(self._ranked[r], no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass

    def wait(self, timeout_s: float | None = None, *, _total_s: float | None = None) -> list:
        """Every rank's value, in rank order (None for a rank given up on)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._pending or self._failure is not None:
            self.check(wait_s=_POLL_S)
            if deadline is not None and time.monotonic() > deadline:
                missing = [r for r in sorted(self._refs.values()) if r not in self.values and r not in self.lost]
                raise LaunchError(f"timed out after {_total_s or timeout_s:.0f}s waiting for ranks {missing}")
        return [self.values.get(r) for r in range(len(self._refs))]

    def stop(self) -> None:
        """Kill every actor, release the placement groups and channels; shut Ray down if this
        job started it. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        ray = self._ray
        for a in self._actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        if self._pgs:
            from ray.util.placement_group import remove_placement_group

            for pg in self._pgs:
                try:
                    remove_placement_group(pg)
                except Exception:  # noqa: BLE001
                    pass
        for c in self._channels:
            c.close()
        if self._started:
            ray.shutdown()


def _follow_plan(ray, placement, groups, targets, made, gpus: bool, strict: bool, node_of, deadline) -> dict:
    """rank -> (group, bundle) so each rank runs on the actor holding its planned GPU; the
    ranks that differ from the plan (another node, another GPU) are one line, or a LaunchError
    when strict (parallel.placement.check_job_placement)."""
    keys = list(made)
    wait = 300.0 if deadline is None else max(1.0, deadline - time.monotonic())
    try:
        held = dict(zip(keys, ray.get([made[key].held.remote(gpus) for key in keys], timeout=wait)))
    except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
        raise _ray_failure(ray, e, 0, node_of) from None
    except ray.exceptions.GetTimeoutError:
        raise LaunchError(f"the Ray actors did not start within {wait:.0f}s") from None
    gpu_of = getattr(placement, "gpu_of", None)
    slot = {}
    for k, ranks in enumerate(groups):
        planned = {r: gpu_of(r) if gpu_of and gpus else None for r in ranks}
        for r, i in match_gpus(planned, [held[k, i][1] for i in range(len(ranks))]).items():
            slot[r] = (k, i)
    if hasattr(placement, "slots"):  # a Placement: say where the job differs from it
        world = len(slot)
        hosts = [placement.node_name(r) if held[slot[r]][0] == targets[slot[r][0]].id else node_of.get(r)
                 for r in range(world)]
        got = [held[slot[r]][1] if gpus else placement.gpu_of(r) for r in range(world)]
        line = check_job_placement(placement, hosts, got, strict=strict)
        if line:
            print(f"atoll: warning: {line}", file=sys.stderr, flush=True)
    return slot


def _ray_failure(ray, err, rank: int, node_of: dict) -> RankFailure:
    """RankFailure for a Ray-level error: a dead actor, or a task Ray could not even start."""
    if isinstance(err, ray.exceptions.RayActorError):  # died, unless it never started
        return RankFailure(rank, _death_cause(err), node=node_of.get(rank),
                           died=not getattr(err, "actor_init_failed", False))
    # RayTaskError: the task's arguments could not be loaded there (fn's module missing on
    # that node, say); keep the inner error's first line, without Ray's wrapping
    text = str(getattr(err, "cause", None) or err)
    text = text.split("System error: ", 1)[-1].split("traceback:", 1)[0]
    return RankFailure(rank, " ".join(text.split()), node=node_of.get(rank))


def _first(ray, ref, node_of, deadline):
    """Rank 0's rendezvous address; its actor must start first."""
    wait = 300.0 if deadline is None else max(1.0, deadline - time.monotonic())
    try:
        return ray.get(ref, timeout=wait)
    except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
        raise _ray_failure(ray, e, 0, node_of) from None
    except ray.exceptions.GetTimeoutError:
        raise LaunchError(f"rank 0's Ray actor did not start within {wait:.0f}s") from None


class _RemoteTraceback(Exception):
    """The failing rank's traceback, chained under RankFailure for debugging."""

    def __str__(self):
        return "\n" + self.args[0]
