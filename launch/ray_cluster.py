"""The Ray cluster side of the Ray launcher: connecting (loopback only when Ray starts here),
what the cluster holds, grouping ranks by node and reserving each group as a STRICT_PACK
placement group (launch/ray_launcher.py says why)."""

from __future__ import annotations

import contextlib
import os
import socket
import sys

from atoll.errors import LaunchError
from atoll.launch import ray_placement as rp
from atoll.launch.ray_placement import planned_nodes, span


def node_groups(world_size: int, placement=None, ranks_per_node: int | None = None) -> list[list[int]]:
    """Ranks grouped by node, in order of first rank: from placement.node_of, else chunks."""
    if placement is not None and hasattr(placement, "node_of"):
        return [ranks for _, ranks in planned_nodes(placement, world_size)]
    per = max(1, min(ranks_per_node or world_size, world_size))
    return [list(range(s, min(s + per, world_size))) for s in range(0, world_size, per)]




def check_address(address: str) -> None:
    """Fail in seconds, with one line, when nothing listens at a host:port address."""
    if address == "auto":
        return
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        host, port = hostport, "6379"
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise LaunchError(f"cannot reach the Ray cluster at {address}: {e.strerror or e}") from None


@contextlib.contextmanager
def loopback_only():
    """While Ray starts on this machine, keep every Ray server on the loopback interface: Ray
    turns 127.0.0.1 into the routable IP and binds it unless it believes clusters are off.
    The servers keep their environment; this process's is restored on leaving."""
    try:
        from ray._private import ray_constants
    except ImportError:  # a Ray without it: the env variable alone still reaches its servers
        ray_constants = None
    saved_env = {k: os.environ.get(k) for k in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_USAGE_STATS_ENABLED")}
    saved_flag = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # inherited by GCS, raylet, workers
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if saved_flag is not None:
        ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if saved_flag is not None:
            ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def connect(ray, address: str | None, world_size: int) -> bool:
    """Connect or start Ray; True when this call did it (and so must shut it down)."""
    if ray.is_initialized():
        return False
    opts = dict(include_dashboard=False, logging_level="warning", configure_logging=True)
    if address is not None:
        check_address(address)
        try:
            ray.init(address=address, **opts)
        except Exception as e:  # noqa: BLE001 - Ray raises several kinds for a bad cluster
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise LaunchError(f"cannot connect to the Ray cluster at {address}: {first}") from None
        return True
    with loopback_only():
        # address="local": a new instance even when RAY_ADDRESS or a running cluster is around
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, world_size),
                 _node_ip_address="127.0.0.1", **opts)
    return True


def node_names(ray) -> dict[str, str]:
    return {n["NodeID"]: f"{n['NodeManagerAddress']} (node {n['NodeID'][:8]})"
            for n in ray.nodes() if n.get("Alive")}


def alive_resources(ray) -> list[dict]:
    return [n["Resources"] for n in ray.nodes() if n.get("Alive")]


def gpus_per_rank(ray, device: str, world_size: int) -> int:
    """1 for cuda; for auto, 1 when the alive nodes hold a GPU per rank, else 0 (CPU ranks)."""
    if device == "cpu":
        return 0
    if device == "cuda":
        return 1
    return int(sum(n.get("GPU", 0) for n in alive_resources(ray)) >= world_size)


def check_totals(ray, world: int, bundle: dict) -> None:
    """Refuse what the cluster can never hold, instead of waiting for a placement group."""
    nodes = alive_resources(ray)
    for kind, per_rank in (("GPU", bundle.get("GPU", 0)), ("CPU", bundle["CPU"])):
        total = sum(n.get(kind, 0) for n in nodes)
        if per_rank and world * per_rank > total:
            raise LaunchError(f"{world} ranks need {world * per_rank:g} {kind}s but the Ray cluster has {total:g}")


def check_groups(ray, groups: list[list[int]], bundle: dict) -> None:
    """Refuse a group of ranks that no node can hold."""
    nodes = alive_resources(ray)
    g = max(groups, key=len)
    for kind, per_rank in (("GPU", bundle.get("GPU", 0)), ("CPU", bundle["CPU"])):
        biggest = max((n.get(kind, 0) for n in nodes), default=0)
        if per_rank and len(g) * per_rank > biggest:
            raise LaunchError(f"{span(g)} must share one node and need {len(g) * per_rank:g} {kind}s, "
                              f"but the largest Ray node has {biggest:g}")


def rank_groups(ray, world_size: int, placement, ranks_per_node, tp_size: int, bundle: dict):
    """(groups of ranks, the Ray node each is pinned to or None) by launch.ray_placement."""
    check_totals(ray, world_size, bundle)
    if placement is None and ranks_per_node is not None:
        return node_groups(world_size, ranks_per_node=ranks_per_node), None
    nodes = rp.ray_nodes(ray)
    if placement is None:
        return rp.pack_tp_groups(world_size, tp_size, nodes, bundle), None
    targets = rp.plan_nodes(placement, world_size, nodes, bundle)
    where = ", ".join(f"{name} -> {node.label}" for (name, _), (node, _) in
                      zip(rp.planned_nodes(placement, world_size), targets))
    print(f"atoll: the plan's nodes on Ray: {where}", file=sys.stderr, flush=True)
    return [ranks for _, ranks in targets], [node for node, _ in targets]


def pin(node_id: str, bundles: int) -> dict:
    """placement_group keywords that keep its bundles on node_id: a bundle label selector on
    Ray's ray.io/node-id label where this Ray has them, else the soft hint older Ray takes (a
    group placed elsewhere anyway is then reported by _follow_plan)."""
    import inspect

    from ray.util.placement_group import placement_group

    params = inspect.signature(placement_group).parameters
    if "bundle_label_selector" in params:
        return {"bundle_label_selector": [{"ray.io/node-id": node_id}] * bundles}
    if "_soft_target_node_id" in params:
        return {"_soft_target_node_id": node_id}
    return {}


def reserve(ray, groups, bundle: dict, ready_timeout_s: float, targets=None) -> list:
    """One STRICT_PACK placement group per group of ranks, pinned to targets[i] when given.
    Their names carry a tag of this job: Ray refuses a name in use, and several jobs (engine
    replicas) reserve groups of the same ranks at once."""
    import uuid

    from ray.util.placement_group import placement_group, remove_placement_group

    job = uuid.uuid4().hex[:8]
    pgs = [placement_group([dict(bundle) for _ in g], strategy="STRICT_PACK", name=f"atoll-{job}-{span(g)}",
                           **(pin(targets[i].id, len(g)) if targets else {}))
           for i, g in enumerate(groups)]
    refs = [pg.ready() for pg in pgs]
    ready, _ = ray.wait(refs, num_returns=len(pgs), timeout=ready_timeout_s)
    if len(ready) < len(pgs):
        late = [i for i, ref in enumerate(refs) if ref not in ready]
        for pg in pgs:
            remove_placement_group(pg)
        free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
        on = f" on {targets[late[0]].label}" if targets else ""
        raise LaunchError(f"Ray could not place {len(groups)} node group(s) of {bundle} per rank "
                          f"within {ready_timeout_s:.0f}s ({span(groups[late[0]])}{on} did not fit); "
                          f"available now: {free}")
    return pgs
