"""Where the Ray launcher puts each rank: the Ray node of each group of ranks, and the rank
each reserved GPU runs. Plain functions over the cluster's node list, so they are tested
without Ray.

With a plan (parallel.placement.Placement): one group per planned node, in the plan's order,
each pinned to one Ray node. Planned nodes are matched to Ray nodes by name when the plan
names them as Ray knows them (node id or its first 8+ hex digits, IP address, host name),
else in the plan's order: planned node k goes to the k-th Ray node that can hold its ranks,
the head node first, then by address and node id. Ray gives each reserved bundle one GPU of
its node; the launcher starts one actor per bundle, reads the GPU each holds (match_gpus),
and hands it the rank the plan puts on that GPU. Where the GPUs Ray reserved on a node are
not the plan's (another job holds one), the ranks take Ray's in the plan's order, and the
launcher says so in one line, or refuses under --strict-placement.

Without a plan, the planner's rule (parallel.placement): consecutive ranks fill the Ray nodes,
largest first, in whole TP groups, so a TP group (tp_size consecutive ranks) never straddles
two nodes while a pipeline stage may go on on the next node.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from atoll.errors import LaunchError


@dataclass(frozen=True)
class RayNode:
    id: str  # Ray's node id (hex)
    address: str  # NodeManagerAddress: the node's IP
    hostname: str
    resources: dict = field(default_factory=dict, compare=False)  # totals: {"CPU": 8.0, "GPU": 8.0, ...}
    head: bool = False

    @property
    def label(self) -> str:
        return f"{self.address} (node {self.id[:8]})"

    def capacity(self, bundle: dict) -> int:
        """How many ranks of `bundle` ({"CPU": c, "GPU": g}) this node holds."""
        room = [self.resources.get(kind, 0) // per for kind, per in bundle.items() if per]
        return int(min(room)) if room else 0

    def matches(self, name: str) -> bool:
        name = str(name)
        return (name in (self.id, self.address, self.hostname, self.hostname.split(".")[0])
                or (len(name) >= 8 and self.id.startswith(name)))


def ray_nodes(ray) -> list[RayNode]:
    """The alive nodes of the connected cluster: the head first, then by address and id."""
    nodes = [RayNode(n["NodeID"], n.get("NodeManagerAddress", ""), n.get("NodeManagerHostname", ""),
                     dict(n.get("Resources", {})), "node:__internal_head__" in n.get("Resources", {}))
             for n in ray.nodes() if n.get("Alive")]
    return sorted(nodes, key=lambda n: (not n.head, n.address, n.id))


def span(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"


def _kind(bundle: dict) -> str:
    return "GPU" if bundle.get("GPU") else "CPU"


def pack_tp_groups(world_size: int, tp_size: int, nodes: list[RayNode], bundle: dict) -> list[list[int]]:
    """Consecutive ranks per node, largest node first, each node taking as many whole TP groups
    (blocks of tp_size ranks) as it holds."""
    if world_size % tp_size:
        raise LaunchError(f"tp_size={tp_size} does not divide {world_size} ranks")
    room = sorted((n.capacity(bundle) for n in nodes), reverse=True)
    kind = _kind(bundle)
    if not room or room[0] < tp_size:
        most = max((n.resources.get(kind, 0) for n in nodes), default=0)
        raise LaunchError(f"a TP group of {tp_size} ranks must share one node and needs {tp_size * bundle[kind]:g} "
                          f"{kind}s, but the largest Ray node has {most:g}")
    groups, start = [], 0
    for cap in room:
        n = min(cap // tp_size * tp_size, world_size - start)
        if n:
            groups.append(list(range(start, start + n)))
            start += n
    if start < world_size:
        raise LaunchError(f"the Ray nodes hold {start} of {world_size} ranks in whole TP groups of {tp_size} "
                          f"(ranks per node: {', '.join(map(str, room))})")
    return groups


def planned_nodes(placement, world_size: int) -> list[tuple[str, list[int]]]:
    """(planned node name, its ranks) in the plan's order (that of each node's first rank).
    A placement-like object needs node_of(rank) only; node_names names its nodes."""
    groups: dict[object, list[int]] = {}
    for r in range(world_size):
        groups.setdefault(placement.node_of(r), []).append(r)
    names = getattr(placement, "node_names", None)
    return [(str(names[k]) if names is not None else str(k), ranks) for k, ranks in groups.items()]


def plan_nodes(placement, world_size: int, nodes: list[RayNode], bundle: dict) -> list[tuple[RayNode, list[int]]]:
    """The Ray node of each planned node, with its ranks (see the module docstring)."""
    planned = planned_nodes(placement, world_size)
    named = {name: [n for n in nodes if n.matches(name)] for name, _ in planned}
    if any(named.values()):
        return _by_name(planned, named, nodes, bundle)
    out, used = [], set()
    for name, ranks in planned:
        free = [n for n in nodes if n.id not in used and n.capacity(bundle) >= len(ranks)]
        if not free:
            have = ", ".join(f"{n.label}: {n.capacity(bundle)}" for n in nodes if n.capacity(bundle)) or "none"
            raise LaunchError(f"no Ray node is left with room for the plan's {name} ({span(ranks)}) after "
                              f"{len(used)} other planned node(s); ranks each Ray node holds: {have}")
        out.append((free[0], ranks))
        used.add(free[0].id)
    return out


def _by_name(planned, named: dict, nodes: list[RayNode], bundle: dict) -> list[tuple[RayNode, list[int]]]:
    out, used = [], {}
    for name, ranks in planned:
        found = named[name]
        if not found:
            raise LaunchError(f"the plan's node {name} is none of the Ray cluster's nodes "
                              f"({', '.join(n.label for n in nodes)}); name nodes by IP, host name or Ray node "
                              f"id, or node0, node1, ... to take Ray's nodes in order")
        fits = [n for n in found if n.capacity(bundle) >= len(ranks)]
        if len(fits) > 1:
            raise LaunchError(f"the plan's node {name} matches {len(fits)} Ray nodes "
                              f"({', '.join(n.label for n in fits)}); name it by Ray node id")
        node = (fits or found)[0]
        if not fits:
            raise LaunchError(f"the plan puts {span(ranks)} on {name}, but Ray node {node.label} holds "
                              f"{node.capacity(bundle)} ranks of {bundle}")
        if node.id in used:
            raise LaunchError(f"the plan's nodes {used[node.id]} and {name} are both Ray node {node.label}")
        used[node.id] = name
        out.append((node, ranks))
    return out


def match_gpus(planned: dict[int, int], held: list[int | None]) -> dict[int, int]:
    """rank -> actor: planned maps each rank of one node to its planned GPU, held[i] is the GPU
    actor i holds (None: no GPU). Each rank takes the actor holding its planned GPU; the ranks
    whose GPU no actor holds take the others, in rank order."""
    out, free = {}, list(range(len(held)))
    for r, g in planned.items():
        if g is not None and g in held:
            i = held.index(g)
            out[r] = i
            free.remove(i)
    for r, i in zip([r for r in planned if r not in out], free):
        out[r] = i
    return out
