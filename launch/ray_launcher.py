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
"""

from __future__ import annotations

import os
import re
import sys
import time
import traceback

from atoll.launch.rank import call_rank
from atoll.errors import LaunchError, RankFailure
from atoll.launch.ray_cluster import check_groups, connect, gpus_per_rank, node_names, rank_groups, reserve

_POLL_S = 0.2
# Ray's switch (ray/_private/accelerators/nvidia_gpu.py) to leave CUDA_VISIBLE_DEVICES alone
NOSET_CUDA_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
GPU_INDEX_VAR = "ATOLL_GPU_INDEX"  # set in each GPU rank's actor: the CUDA index it computes on
_GRACE_S = 2.0  # after a rank raises, how long to look for a dead actor, the likelier root cause


def _import_ray():
    try:
        import ray
    except ImportError:
        raise LaunchError("the Ray launcher needs Ray: pip install 'atoll[ray]'") from None
    return ray


class _RankActor:
    """One rank. Made a Ray actor class by ray.remote at launch (Ray is imported lazily)."""

    def held(self, gpus: bool) -> tuple[str, int | None]:
        """(this actor's Ray node id, the CUDA index of the GPU it holds, or None)."""
        import ray

        index = gpu_index(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES")) if gpus else None
        return ray.get_runtime_context().get_node_id(), index

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0 only: a socket on this node's IP, held until run() hands it to the store."""
        import ray

        from atoll.launch.net import listen_socket

        ip = ray.util.get_node_ip_address()
        self._listen = listen_socket(ip)
        return ip, self._listen.getsockname()[1]

    def run(self, fn, rank, world_size, addr, port, requested, local_rank, args, kwargs):
        """requested: the job's device, or "cpu" when the job reserved no GPU."""
        try:
            import ray
            import torch

            from atoll.launch.device import bind, decide
            from atoll.launch.net import NODE_VAR, pin_interface, rendezvous

            os.environ[NODE_VAR] = ray.get_runtime_context().get_node_id()
            torch.set_num_threads(max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1))))
            index = None
            if requested != "cpu":  # this actor holds one GPU; it sees all of its node's
                index = gpu_index(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"))
                os.environ[GPU_INDEX_VAR] = str(index)
            device = decide(requested, local_rank, index=index)
            if world_size > 1:
                pin_interface(ray.util.get_node_ip_address())
                rendezvous(rank, world_size, addr, port, device=device, requested=requested,
                           listen=getattr(self, "_listen", None))
            else:
                bind(device)
            return ("ok", call_rank(fn, rank, world_size, args, kwargs))
        except BaseException as e:  # report to the driver; the driver kills every actor
            from atoll.errors import AtollError

            line = str(e) if isinstance(e, AtollError) else f"{type(e).__name__}: {e}"
            return ("error", line, traceback.format_exc())


def gpu_index(assigned_ids, cuda_visible_devices: str | None) -> int:
    """The CUDA index, among the devices this actor sees, of the one GPU Ray assigned it.

    assigned_ids: ray.get_gpu_ids(), which are the node's CUDA_VISIBLE_DEVICES entries when
    the node set that variable, else indices into the node's GPUs. cuda_visible_devices: this
    actor's CUDA_VISIBLE_DEVICES (left as the node's, since Ray was told not to narrow it).
    """
    from atoll.launch.device import DeviceError

    ids = [str(i).strip() for i in assigned_ids]
    if len(ids) != 1:
        raise DeviceError(f"expected Ray to assign this rank one GPU, got {ids or 'none'}")
    if cuda_visible_devices is None:
        return int(ids[0])
    visible = [d.strip() for d in cuda_visible_devices.split(",") if d.strip()]
    if ids[0] not in visible:
        raise DeviceError(f"Ray assigned GPU {ids[0]} but CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} "
                          f"does not list it")
    return visible.index(ids[0])


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


def run_ray(fn, world_size: int, *args, address: str | None = None, device: str = "cpu",
            timeout_s: float | None = None, placement=None, ranks_per_node: int | None = None,
            tp_size: int = 1, strict_placement: bool = False, cpus_per_rank: float = 1,
            ready_timeout_s: float = 60.0, **kwargs) -> list:
    """Run fn(rank, world_size, *args, **kwargs) in one Ray actor per rank; return their values.

    address: a Ray cluster ("host:port", "ray://host:port", "auto"); None starts Ray on this
    machine only, listening on 127.0.0.1. If Ray is already initialised it is used as is.
    device: "cuda" (one GPU per rank), "auto" (one GPU per rank when the cluster has that many,
    CUDA only if every rank's torch sees its GPU) or "cpu" (no GPU reserved).
    placement: a plan's rank -> (node, GPU) (parallel.placement.Placement, or any object with
    node_of(rank)); where Ray's GPUs differ from it, one warning line, or LaunchError when
    strict_placement. tp_size: without a placement, each TP group's ranks share a node.
    Raises RankFailure naming the first rank that raised or died, after killing every actor.
    """
    from atoll.launch.device import check_requested

    check_requested(device)
    ray = _import_ray()
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    started = connect(ray, address, world_size)
    pgs, actors = [], []
    try:
        gpus = gpus_per_rank(ray, device, world_size)
        requested = device if gpus else "cpu"  # auto without a GPU each: CPU ranks
        bundle = {"CPU": cpus_per_rank, **({"GPU": gpus} if gpus else {})}
        groups, targets = rank_groups(ray, world_size, placement, ranks_per_node, tp_size, bundle)
        check_groups(ray, groups, bundle)
        pgs = reserve(ray, groups, bundle, ready_timeout_s, targets)
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
        actors = list(made.values())
        node_of: dict[int, str | None] = {}
        for k, (pg, g) in enumerate(zip(pgs, groups)):
            bundle_nodes = ray.util.placement_group_table(pg)["bundles_to_node_id"]
            for r in g:
                node_of[r] = names.get(bundle_nodes.get(g.index(r)), bundle_nodes.get(g.index(r)))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        slot = {r: (k, g.index(r)) for k, g in enumerate(groups) for r in g}  # rank -> (group, bundle)
        if targets is not None:
            slot = _follow_plan(ray, placement, groups, targets, made, bool(gpus), strict_placement,
                                node_of, deadline)
        ranked = [made[slot[r]] for r in range(world_size)]
        addr, port = _first(ray, ranked[0].rendezvous.remote(), node_of, deadline)
        refs = {a.run.remote(fn, r, world_size, addr, port, requested, slot[r][1], args, kwargs): r
                for r, a in enumerate(ranked)}
        return _collect(ray, refs, node_of, deadline, timeout_s)
    finally:
        for a in actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        if pgs:
            from ray.util.placement_group import remove_placement_group

            for pg in pgs:
                try:
                    remove_placement_group(pg)
                except Exception:  # noqa: BLE001
                    pass
        if started:
            ray.shutdown()


def _follow_plan(ray, placement, groups, targets, made, gpus: bool, strict: bool, node_of, deadline) -> dict:
    """rank -> (group, bundle) so each rank runs on the actor holding its planned GPU; the
    ranks that differ from the plan (another node, another GPU) are one line, or a LaunchError
    when strict (parallel.placement.check_job_placement)."""
    from atoll.launch.ray_placement import match_gpus

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
        from atoll.parallel.placement import check_job_placement

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
    if isinstance(err, ray.exceptions.RayActorError):
        return RankFailure(rank, _death_cause(err), node=node_of.get(rank))
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


def _collect(ray, refs: dict, node_of: dict, deadline, timeout_s) -> list:
    values: dict[int, object] = {}
    pending = list(refs)
    failure = None  # (rank, cause, traceback) of the first rank that raised
    failed_at = 0.0
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=_POLL_S)
        for ref in ready:
            rank = refs[ref]
            try:
                msg = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                raise _ray_failure(ray, e, rank, node_of) from None  # a dead actor: the root cause
            if msg[0] == "ok":
                values[rank] = msg[1]
            elif failure is None:
                failure, failed_at = (rank, msg[1], msg[2]), time.monotonic()
        now = time.monotonic()
        if failure is not None and (not pending or now - failed_at > _GRACE_S):
            raise RankFailure(failure[0], failure[1], node=node_of.get(failure[0])) \
                from _RemoteTraceback(failure[2])
        if deadline is not None and now > deadline:
            missing = [r for r in sorted(refs.values()) if r not in values]
            raise LaunchError(f"timed out after {timeout_s:.0f}s waiting for ranks {missing}")
    return [values[r] for r in range(len(refs))]


class _RemoteTraceback(Exception):
    """The failing rank's traceback, chained under RankFailure for debugging."""

    def __str__(self):
        return "\n" + self.args[0]
